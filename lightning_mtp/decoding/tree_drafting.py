"""Tree drafting with the MTP modules: several candidates per depth, one batched call per depth, drafts beyond D.

Indexing as in :mod:`lightning_mtp.decoding.drafting` (``n`` = a row's newest position; depth k at position i predicts
t(i+k+1)). A cascaded module k reads h_(k-1)(j) and Emb(t(j+k)) at position j. Its entries split in two:

* the **linear part**, positions ``j <= n - k``: every input is a committed token, the same for every branch. It is
  computed once (the positions not computed yet: ``windows[k-1]`` of them ending at ``n - k``), written to the
  module's positional KV cache at slot j, and its outputs h_k(j) are kept (``hidden[k]``) for module k+1;
* the **tree part**, positions ``n - k + m`` for the tree's nodes c at depths ``m = 1 .. k-1``: input Emb(token of c)
  and h_(k-1) *at c's parent* (module k-1's output there; at the root, module k-1's last linear output). These are the
  tree itself shifted by k, run as extra tokens of the same call with a tree attention mask (each node sees the linear
  slots and its ancestors), written at scratch slots ``n + local index`` that the next step's linear part overwrites.

Module k's outputs at the nodes of depth k-1 give the logits of depth k; their best candidates (greedy: top-b of the
logits; sampling, static trees: drawn without replacement from the draft distribution q, Gumbel-top-b; dynamic trees:
top-b of q, verified as point masses) become the nodes of depth k. Depths beyond the number D of modules re-apply the
last cascaded module on its own output (as vLLM does for k > n_predict), each virtual depth with its own KV cache.

Parallel heads (Meta 2024) all read h_0(n-1): head k's candidates are the same under every node of depth k-1.

After verification only the accepted path matters: the trunk's hidden states along it are :meth:`observe`-d at their
positions and every module's linear window grows by the tokens the row advanced (:meth:`commit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.drafting import drafter_buffers
from lightning_mtp.decoding.sampling import SamplingParams, logits_to_probs, sample
from lightning_mtp.decoding.tree import DraftTree, TreeShape, ancestors, static_layout, tree_attention_mask
from lightning_mtp.layers import KVCache, attention_width


@dataclass
class TreeDraftState:
    caches: list[KVCache]
    """One KV cache per drafted depth (depths beyond D re-use the last module's weights, not its cache)."""
    hidden: Tensor
    """(S, B, L, H) by position: index 0 the trunk's h_0, index k the linear outputs h_k of depth k (cascaded)."""
    windows: list[int]
    """Per depth: linear positions (ending at the depth's linear end) still to compute."""
    rows: Tensor
    """(B, 1) row indices."""
    ran: int = 0
    """Depths drafted in the current step."""
    chained: bool = False
    """Whether the current step drafted a chain (its nodes are entries at their own positions, see :meth:`commit`)."""


@dataclass
class _Candidates:
    """Every candidate node created so far in a step (global index 0 = the root; depth-d nodes follow depth d-1)."""

    tokens: Tensor  # (B, G+1)
    parents: Tensor  # (B, G+1)
    depths: Tensor  # (B, G+1)
    scores: Tensor  # (B, G+1) cumulative draft log-probability (dynamic trees)


class DepthNodes(NamedTuple):
    """The tree part of one depth's call: nodes of depths 1..k-1 run as extra tokens (breadth-first)."""

    tokens: Tensor  # (B, M) token of each node (-1 = absent: embedded as 0, never accepted)
    depths: Tensor  # (B or 1, M) depth of each node
    parent_hidden: Tensor  # (B, M, H) h_(k-1) at each node's parent
    anc: Tensor  # (B, M, M) ancestors-or-self among the nodes


class MTPTreeDrafter:
    """Drafts trees (and chains: ``TreeShape.chain(k)``) with the MTP modules of an ``MTPMixin`` module.

    Args:
        module: the ``MTPMixin`` module.
        max_depth: the deepest tree any step of the call drafts (may exceed D for cascaded modules).
    """

    def __init__(self, module: nn.Module, max_depth: int) -> None:
        self.module = module
        self.modules = module.require_mtp_modules()
        self.cascaded = module.mtp_config.architecture == "cascaded"
        self.num_modules = len(self.modules)
        if not self.cascaded and max_depth > self.num_modules:
            raise ValueError(
                f"drafts beyond the MTP depth need cascaded modules: parallel heads predict fixed offsets, so a "
                f"draft depth of {max_depth} needs {max_depth} heads, the model has D={self.num_modules} "
                "(--model.generation.draft_tokens / draft_tree)"
            )
        self.max_drafts = max_depth
        self.embed = module.mtp_draft_embedding() if self.cascaded else None
        self._static: dict[tuple, Any] = {}  # static trees' tables, window offsets, chain tables

    def static_tables(self, shape: TreeShape, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(ranks, ancestors (1, N+1, N+1), parents (1, N+1), depths (1, N+1)) of a static tree (once per shape)."""
        key = (shape.branching, str(device))
        if key not in self._static:
            layout = static_layout(shape, device)
            self._static[key] = (layout.ranks, ancestors(layout.parents.unsqueeze(0), shape.depth),
                                 layout.parents.unsqueeze(0), layout.depths.unsqueeze(0))
        return self._static[key]

    def _module_index(self, depth: int) -> int:
        return min(depth, self.num_modules) - 1

    def allocate(self, batch_size: int, max_len: int) -> TreeDraftState:
        blocks = [self.modules[self._module_index(depth)] for depth in range(1, self.max_drafts + 1)]
        caches, hidden, rows = drafter_buffers(self.module, blocks, self.cascaded, batch_size, max_len)
        return TreeDraftState(caches, hidden, [0] * self.max_drafts, rows)

    def observe(self, state: TreeDraftState, hidden: Tensor, positions: Tensor) -> None:
        """The trunk's hidden states (B, T, H) at ``positions`` (B, T) (prefill, and the accepted path)."""
        state.hidden[0][state.rows, positions] = hidden.to(state.hidden.dtype)

    def commit(self, state: TreeDraftState, advanced: int) -> None:
        """Every row's newest token moved by at most ``advanced`` positions.

        A depth that ran recomputes the ``advanced`` linear positions its linear end moved by, except after a chain
        (cascaded): its k-1 nodes were computed at their own positions ``n-k+1 .. n-1`` and those whose drafts were
        all accepted stay valid (as in the chain drafter), so only ``max(advanced - k + 1, 1)`` remain: with ``a``
        accepted-plus-bonus tokens, entries up to ``n + a - 1 - k`` read accepted tokens only."""
        for k in range(self.max_drafts):
            if k >= state.ran:
                state.windows[k] += advanced
            elif state.chained and self.cascaded:
                state.windows[k] = max(advanced - k, 1)  # depth k + 1
            else:
                state.windows[k] = advanced
        state.ran, state.chained = 0, False

    # ------------------------------------------------------------------------------------------- one depth
    def _run_depth(self, state: TreeDraftState, k: int, tokens: Tensor, newest: Tensor,
                   nodes: Optional[DepthNodes] = None) -> tuple[Tensor, int]:
        """Run depth k over its linear window and the tree ``nodes`` (depths 1..k-1, breadth-first; ``None``: none).
        Returns the outputs (B, W + M, H) and W: index W - 1 is the root's (the last linear position), W.. the
        nodes'."""
        rows, module, cache = state.rows, self.modules[self._module_index(k)], state.caches[k - 1]
        shift = k if self.cascaded else 1
        linear_end = newest - shift  # (B,)
        width = state.windows[k - 1]
        steps = torch.arange(-width + 1, 1, device=newest.device)
        raw = linear_end.unsqueeze(1) + steps  # (B, W); < 0 before the sequence starts (a prompt shorter than k)
        linear = raw.clamp_min(0)  # (B, W) positions read (RoPE, inputs)
        # Entries at positions < 0 exist in no sequence (training computes none): they go to the cache's last slot,
        # which no real position reaches and no query sees, instead of overwriting position 0.
        linear_slots = torch.where(raw >= 0, raw, cache.max_len - 1)
        source = state.hidden[k - 1] if self.cascaded else state.hidden[0]
        h_in = source[rows, linear]  # (B, W, H)
        emb = self.embed(tokens[rows, linear + k]) if self.cascaded else None  # Emb(t(j+k)), committed
        positions, slots, mask = linear, linear_slots, None
        if nodes is not None:
            size = nodes.tokens.shape[1]
            h_in = torch.cat([h_in, nodes.parent_hidden], dim=1)
            emb = torch.cat([emb, self.embed(nodes.tokens.clamp_min(0))], dim=1)
            node_raw = linear_end.unsqueeze(1) + nodes.depths  # (B, M), < 0 for the first steps of a short prompt
            positions = torch.cat([linear, node_raw.clamp_min(0)], dim=1)
            slots = torch.cat([linear_slots, newest.unsqueeze(1) + torch.arange(size, device=newest.device)], dim=1)
            # nodes before position 0 are nobody's key but their own (a query must see something)
            own = torch.eye(size, dtype=torch.bool, device=newest.device)
            anc = nodes.anc & ((node_raw >= 0).unsqueeze(1) | own)
            used = attention_width(newest + (size - 1), cache.max_len)  # slots in use, rounded
            mask = tree_attention_mask(linear_end, newest, anc, used, linear)  # (B, 1, W + M, used)
        cos, sin = self.module.mtp_rope(positions.shape[1], positions)
        out = module(h_in, emb, cos, sin, slots, cache, mask)  # (B, W + M, H)
        if self.cascaded and k < self.max_drafts:
            state.hidden[k][rows, linear_slots] = out[:, :width].to(state.hidden.dtype)
        return out, width

    def _tree_nodes(self, state: TreeDraftState, k: int, cand: _Candidates, node_index: Tensor,
                    node_hidden: Tensor, static_anc: Optional[Tensor]) -> Optional[DepthNodes]:
        """The tree part of depth k: the nodes ``node_index`` (B, M) (global indices) with h_(k-1) at their parents
        and their ancestors among themselves (chains never come here: :meth:`_draft_chain`)."""
        size = node_index.shape[1]
        if not size:
            return None
        rows, batch = state.rows, node_index.shape[0]
        if static_anc is not None:  # static trees: this depth's nodes are 1..M (breadth-first)
            parents = cand.parents[:, 1 : size + 1].expand(batch, size)
            node_tokens, node_depths = cand.tokens[:, 1 : size + 1], cand.depths[:, 1 : size + 1]
            anc = static_anc[:, 1 : size + 1, 1 : size + 1].expand(batch, size, size)
        else:
            parents = cand.parents[rows, node_index]  # (B, M) global
            node_tokens, node_depths = cand.tokens[rows, node_index], cand.depths[rows, node_index]
            anc_all = ancestors(cand.parents, k)  # (B, G+1, G+1): the global table restricted to node_index
            anc = anc_all[rows, node_index].gather(2, node_index.unsqueeze(1).expand(-1, size, -1))
        return DepthNodes(node_tokens, node_depths, node_hidden[rows, parents], anc)

    # ------------------------------------------------------------------------------------------- candidates
    def _candidates(self, logits: Tensor, count: int, params: SamplingParams, sampled: bool,
                    generator: Optional[torch.Generator], k: int,
                    scored: bool = True) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """Children of every frontier node from its depth-k logits (B, F, V): tokens (B, F, count) (-1 = none),
        their draft log-probabilities, and the distribution they were drawn from (sampled candidates only)."""
        temperature = self.module.mtp_draft_temperatures[self._module_index(k)]
        if params.greedy:
            if not scored:  # static trees only need the order, which the draft temperature does not change
                values, tokens = logits.topk(count, dim=-1)
                return tokens, torch.zeros_like(values, dtype=torch.float32), None
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            values, tokens = logp.topk(count, dim=-1)
            return tokens, values, None
        q = logits_to_probs(logits / temperature, params.temperature, params.top_k, params.top_p)  # (B, F, V)
        keys = logq = torch.log(q)
        if sampled:  # Gumbel-top-b = `count` draws without replacement, in draw order
            uniform = torch.rand(q.shape, device=q.device, generator=generator).clamp_min(1e-20)
            keys = logq - torch.log(-torch.log(uniform))
        top, tokens = keys.topk(count, dim=-1)
        values = logq.gather(-1, tokens)
        tokens = torch.where(torch.isfinite(top), tokens, torch.full_like(tokens, -1))
        return tokens, torch.where(tokens >= 0, values, torch.full_like(values, float("-inf"))), (
            q if sampled else None)

    # ------------------------------------------------------------------------------------------- the tree
    def draft(self, state: TreeDraftState, tokens: Tensor, newest: Tensor, shape: TreeShape,
              params: SamplingParams, generator: Optional[torch.Generator] = None) -> DraftTree:
        """Draft one tree of ``shape`` after every row's newest token (``tokens`` (B, L) holds committed tokens)."""
        if shape.depth > self.max_drafts:
            raise ValueError(f"tree depth {shape.depth} exceeds this call's drafter depth {self.max_drafts}")
        if shape.is_chain:
            return self._draft_chain(state, tokens, newest, shape.depth, params, generator)
        batch, device, rows = tokens.shape[0], tokens.device, state.rows
        sampled = not params.greedy and not shape.dynamic
        root = tokens.gather(1, newest.view(-1, 1))  # (B, 1)
        zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
        cand = _Candidates(root, zeros, zeros, torch.zeros(batch, 1, device=device))
        frontier = zeros  # (B, F) global indices of the nodes whose children this depth drafts
        module_nodes = zeros[:, :0]  # (B, M) nodes the tree part of the next depth runs over
        node_hidden = None  # (B, G+1, H) previous depth's outputs by node (root at 0)
        draft_q: list[tuple[Tensor, Tensor]] = []  # (frontier, q) of sampled candidates
        static_anc = None
        if not shape.dynamic:
            _, static_anc, static_parents, static_depths = self.static_tables(shape, device)
        state.ran = 0
        for k in range(1, shape.depth + 1):
            nodes = self._tree_nodes(state, k, cand, module_nodes, node_hidden, static_anc)
            out, linear_width = self._run_depth(state, k, tokens, newest, nodes)
            root_out, node_out = out[:, linear_width - 1], out[:, linear_width:]
            state.ran = k
            size = cand.tokens.shape[1]
            if self.cascaded and static_anc is not None:  # nodes 1..M ran, in order; the frontier is their tail
                node_hidden = torch.cat([root_out.unsqueeze(1), node_out], dim=1)  # (B, 1 + M, H)
                frontier_hidden = node_hidden[:, node_hidden.shape[1] - frontier.shape[1]:]  # (B, F, H)
            elif self.cascaded:
                node_hidden = root_out.new_zeros(batch, size, root_out.shape[-1])
                node_hidden[:, 0] = root_out
                if module_nodes.shape[1]:
                    node_hidden[rows, module_nodes] = node_out
                frontier_hidden = node_hidden[rows, frontier]  # (B, F, H)
            else:
                frontier_hidden = root_out.unsqueeze(1)  # one head, the same children under every node
            logits = self.module.mtp_depth_logits(self._module_index(k) + 1, frontier_hidden)  # (B, F|1, V)
            count = shape.top_k if shape.dynamic else shape.branching[k - 1]
            count = min(count, logits.shape[-1])
            child_tokens, child_logp, q = self._candidates(logits, count, params, sampled, generator, k,
                                                           scored=shape.dynamic)
            width = frontier.shape[1]
            if child_tokens.shape[1] != width:  # parallel heads: the same candidates under each frontier node
                child_tokens = child_tokens.expand(batch, width, count)
                child_logp = child_logp.expand(batch, width, count)
                q = None if q is None else q.expand(batch, width, q.shape[-1])
            if q is not None:
                draft_q.append((frontier, q))
            new_index = size + torch.arange(width * count, device=device).expand(batch, -1)  # (B, F*count)
            if static_anc is not None:  # node tables are the precomputed layout; candidates are never absent
                if not params.greedy:  # ... unless q has fewer tokens than the branching (then -1, and below)
                    parent_ok = cand.tokens[:, size - width : size] >= 0
                    child_tokens = torch.where(parent_ok.unsqueeze(2), child_tokens, torch.full_like(child_tokens, -1))
                end = size + width * count
                cand = _Candidates(torch.cat([cand.tokens, child_tokens.reshape(batch, -1)], dim=1),
                                   static_parents[:, :end], static_depths[:, :end], cand.scores)
            else:
                parent_ok = cand.tokens[rows, frontier] >= 0  # (B, F) children of an absent node are absent
                child_tokens = torch.where(parent_ok.unsqueeze(2), child_tokens, torch.full_like(child_tokens, -1))
                scores = cand.scores[rows, frontier].unsqueeze(2) + child_logp  # (B, F, count)
                scores = torch.where(child_tokens >= 0, scores, torch.full_like(scores, float("-inf")))
                cand = _Candidates(
                    torch.cat([cand.tokens, child_tokens.reshape(batch, -1)], dim=1),
                    torch.cat([cand.parents, frontier.repeat_interleave(count, dim=1)], dim=1),
                    torch.cat([cand.depths, torch.full_like(new_index, k)], dim=1),
                    torch.cat([cand.scores, scores.reshape(batch, -1)], dim=1),
                )
            if k == shape.depth:
                break
            if shape.dynamic:  # EAGLE-2: expand the top_k new nodes by cumulative draft probability
                best = scores.reshape(batch, -1).topk(min(shape.top_k, width * count), dim=1).indices
                frontier = new_index.gather(1, best.sort(dim=1).values)
            else:
                frontier = new_index
            if self.cascaded:
                module_nodes = torch.cat([module_nodes, frontier], dim=1)
        tree = self._finish(cand, shape, draft_q)
        return tree if static_anc is None else tree._replace(anc=static_anc)

    def _draft_chain(self, state: TreeDraftState, tokens: Tensor, newest: Tensor, depth: int,
                     params: SamplingParams, generator: Optional[torch.Generator] = None) -> DraftTree:
        """:meth:`draft` of ``TreeShape.chain(depth)`` (chains longer than D) as the chain drafter computes chains,
        without a tree's bookkeeping. Depth k's call covers its linear window and the chain's k-1 nodes, the
        consecutive positions ``n - k + 1 .. n - 1``: one causal window ending at ``n - 1``, reading h_(k-1) from
        ``hidden[k-1]`` (depth k-1 wrote its whole window there, drafts included) and each draft from ``tokens`` at
        ``n + k``. Entries past a depth's linear end are draft-dependent; a later step recomputes them (commit)."""
        device, rows = tokens.device, state.rows
        chain = [tokens.gather(1, newest.view(-1, 1))]  # (B, 1) each: the root, then one draft per depth
        probs: Optional[list[Tensor]] = None if params.greedy else []
        state.ran, state.chained = 0, True
        for k in range(1, depth + 1):
            module = self.modules[self._module_index(k)]
            cache = state.caches[k - 1]
            size = state.windows[k - 1] + (k - 1 if self.cascaded else 0)  # linear window + the chain's nodes
            raw = newest.unsqueeze(1) + self._window_steps(size, device)  # (B, W) positions n-W .. n-1; < 0: none
            positions = raw.clamp_min(0)
            # positions < 0 (a prompt shorter than the depth) exist in no sequence: the cache's last slot, unseen
            slots = torch.where(raw >= 0, raw, cache.max_len - 1)
            if self.cascaded:
                h_in = state.hidden[k - 1][rows, positions]  # (B, W, H) h_(k-1), depth k-1's drafts included
                emb = self.embed(tokens[rows, positions + k])  # (B, W, H) Emb(t(j+k)), drafts beyond n
            else:
                h_in, emb = state.hidden[0][rows, positions], None  # (B, W, H) h_0
            cos, sin = self.module.mtp_rope(size, positions)
            out = module(h_in, emb, cos, sin, slots, cache)  # (B, W, H), causal
            state.ran = k
            if self.cascaded and k < self.max_drafts:
                state.hidden[k][rows, slots] = out.to(state.hidden.dtype)
            logits = self.module.mtp_depth_logits(self._module_index(k) + 1, out[:, -1])  # (B, V) at n - 1
            if probs is None:
                token = logits.argmax(dim=-1)  # (B,)
            else:
                temperature = self.module.mtp_draft_temperatures[self._module_index(k)]
                q = logits_to_probs(logits / temperature, params.temperature, params.top_k, params.top_p)  # (B, V)
                token = sample(q, generator)
                probs.append(q)
            if self.cascaded and k < depth:
                tokens.scatter_(1, (newest + k).unsqueeze(1), token.unsqueeze(1))  # depth k+1 embeds it
            chain.append(token.unsqueeze(1))
        node_tokens = torch.cat(chain, dim=1)  # (B, depth + 1)
        batch = node_tokens.shape[0]
        depths, parents = self._chain_tables(depth, device)
        tree_probs = None
        if probs is not None:  # at each node, the distribution of its child (the last node has none)
            tree_probs = torch.stack(probs + [torch.zeros_like(probs[0])], dim=1).float()  # (B, depth + 1, V)
        return DraftTree(node_tokens, parents.expand(batch, -1), depths.expand(batch, -1), tree_probs)

    def _window_steps(self, size: int, device: torch.device) -> Tensor:
        """(size,) offsets -size .. -1 (cached)."""
        key = ("window", size, str(device))
        if key not in self._static:
            self._static[key] = torch.arange(-size, 0, device=device)
        return self._static[key]

    def _chain_tables(self, depth: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(depths, parents), each (1, depth + 1), of a chain (cached)."""
        key = ("chain", depth, str(device))
        if key not in self._static:
            depths = torch.arange(depth + 1, device=device).unsqueeze(0)
            self._static[key] = (depths, (depths - 1).clamp_min(0))
        return self._static[key]

    def _finish(self, cand: _Candidates, shape: TreeShape, draft_q: list[tuple[Tensor, Tensor]]) -> DraftTree:
        """The step's tree (static: every candidate; dynamic: the ``nodes`` best, breadth-first)."""
        batch, size = cand.tokens.shape
        rows = torch.arange(batch, device=cand.tokens.device).unsqueeze(1)
        probs = None
        if draft_q:
            vocab = draft_q[0][1].shape[-1]
            probs = cand.tokens.new_zeros(batch, size, vocab, dtype=torch.float32)
            for frontier, q in draft_q:
                probs[rows, frontier] = q.float()
        if not shape.dynamic:
            return DraftTree(cand.tokens, cand.parents.expand(batch, size), cand.depths.expand(batch, size), probs)
        nodes = min(shape.nodes, size - 1)
        # ties: a child never outranks its parent (keeps the chosen set ancestor-closed)
        key = cand.scores[:, 1:] - 1e-6 * cand.depths[:, 1:]
        chosen = key.topk(nodes, dim=1).indices + 1  # (B, N) global indices
        order = cand.depths.gather(1, chosen) * size + chosen  # breadth-first: by depth, then creation order
        chosen = chosen.gather(1, order.argsort(dim=1))
        index = torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1)  # (B, N+1) with the root
        local = torch.zeros(batch, size, dtype=torch.long, device=chosen.device)
        local.scatter_(1, index, torch.arange(nodes + 1, device=chosen.device).expand(batch, -1))
        parents = local.gather(1, cand.parents.gather(1, index))
        return DraftTree(cand.tokens.gather(1, index), parents, cand.depths.gather(1, index), None)
