"""The MTP training objective: run the active depths on teacher-forced tokens, score them jointly with the main
head, add the registered loss terms (:meth:`MTPObjective.compute_lm_loss`, :meth:`MTPObjective.compute_mtp_loss`).

Packed batches (``position_ids``, several documents per row) keep documents apart everywhere: the trunk gets the
position ids (:meth:`~lightning_mtp.mixin.contract.MTPHostContract.mtp_run_trunk`), every depth attends within its
document with RoPE at the in-document position, and no target of any depth, the main head's included, lies in another
document than its position (:func:`~lightning_mtp.loss.depth_targets`)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.layers import document_mask
from lightning_mtp.loss import DepthLossPart, DepthLossSpec, combine_parts, depth_targets, run_depth, score_jointly
from lightning_mtp.outputs import LossTerm, MTPForward, MTPLossOutput


class MTPObjective:
    """Loss orchestration; reads the host contract and the built modules."""

    def register_mtp_loss_term(self, name: str, term: LossTerm) -> None:
        """Add ``term(module, forward) -> scalar`` to the training loss; it is logged as ``train/mtp/<name>``."""
        self._mtp_loss_terms[name] = term

    def unregister_mtp_loss_term(self, name: str) -> None:
        """Remove a term added by :meth:`register_mtp_loss_term` (no error when absent)."""
        self._mtp_loss_terms.pop(name, None)

    def mtp_forward(
        self, hidden: Tensor, input_ids: Tensor, labels: Optional[Tensor] = None, position_ids: Optional[Tensor] = None
    ) -> MTPForward:
        """Run every active depth on teacher-forced tokens; returns per-depth normed hidden states.

        hidden: (B, T, H) trunk's last hidden state h_0. Depth k covers positions 0..T-k-2, the ones with a target.
        position_ids: (B, T) of a packed batch (documents kept apart), or ``None``.
        """
        self.mtp_whole_root()
        return self._run_depths(hidden, input_ids, labels, with_loss=False, position_ids=position_ids)[0]

    def _score(
        self, fwd: MTPForward, specs: list[DepthLossSpec], main: Optional[DepthLossSpec] = None,
        states_kept: bool = False,
    ) -> MTPLossOutput:
        """Score the main head (if given) and every active depth jointly: one cross-entropy call per head.

        ``states_kept``: the caller keeps the normed states (another reference to them), so they must stay intact.
        """
        hidden = ([fwd.main_hidden] if main is not None else []) + list(fwd.depth_hidden)
        private = not (states_kept or (self._mtp_loss_terms and torch.is_grad_enabled()))
        if private:
            # Nothing reads the normed states after scoring: the scorer writes their gradients into them.
            fwd.main_hidden, fwd.depth_hidden = None, []
        parts = score_jointly(([main] if main is not None else []) + specs, hidden, self.mtp_logit_transform(),
                              private)
        main_part = parts.pop(0) if main is not None else None
        return self._finish(fwd, parts, main_part)

    def _run_depths(
        self, hidden: Tensor, input_ids: Tensor, labels: Optional[Tensor], with_loss: bool,
        run_depths: Optional[int] = None, trunk_embeddings: Optional[TrunkEmbeddings] = None,
        position_ids: Optional[Tensor] = None,
    ) -> tuple[MTPForward, list[DepthLossSpec]]:
        """The depth loop over ``run_depths`` depths (default: the active ones); loss specs for the active depths
        only, weighted λ / active · w_k. With ``recompute`` each depth (module and output norm) keeps, between forward
        and backward, only its inputs and the block's mid residual, and its backward reruns it once
        (:func:`run_depth`). ``trunk_embeddings``: the trunk's own lookup of ``input_ids``, which the cascaded depths
        read instead of a second lookup when the draft embedding is the trunk's (:class:`TrunkEmbeddings`).
        ``position_ids`` (B, T): packed documents; depth k's positions 0..L-1 (L = T-k-1) attend within their
        documents (the top-left (L, L) corner of one block-diagonal mask) with RoPE at their in-document positions,
        and their targets are masked across documents."""
        modules = self.require_mtp_modules()
        cfg = self.mtp_config
        B, T = input_ids.shape
        self._check_trunk_hidden(hidden, input_ids)
        if position_ids is not None and tuple(position_ids.shape) != (B, T):
            raise ValueError(f"position_ids must have input_ids' shape {(B, T)}, got {tuple(position_ids.shape)}")
        if T < cfg.depth + 2:
            raise ValueError(
                f"sequence length {T} is shorter than MTPConfig.depth + 2 = {cfg.depth + 2}: depth {cfg.depth} "
                "would have no target (raise --data.seq_len or lower --model.mtp.depth)"
            )
        labels = input_ids if labels is None else labels
        trunk = hidden.detach() if cfg.detach_trunk else hidden
        embeddings = None
        if cfg.architecture == "cascaded":
            embedding = self.mtp_draft_embedding()
            shared = embedding is self.mtp_token_embedding()
            # detach_trunk keeps the MTP loss out of the host's embedding, not out of the MTP modules' own one.
            grad = torch.is_grad_enabled() and not (cfg.detach_trunk and shared)
            embeddings = trunk_embeddings.get(hidden.shape) if shared and trunk_embeddings is not None else None
            if embeddings is not None:
                embeddings = embeddings if grad else embeddings.detach()
            else:
                with torch.set_grad_enabled(grad):
                    embeddings = embedding(input_ids)  # (B, T, H)
        cos, sin = self.mtp_rope(T) if position_ids is None else self.mtp_rope(T, position_ids)  # (1 or B, T, hd/2)
        mask = None if position_ids is None else document_mask(position_ids)  # (B, 1, T, T)
        recompute = cfg.recompute and torch.is_grad_enabled()
        scale = self.mtp_loss_weight / max(self.mtp_active_depth, 1)
        previous, depth_hidden, specs = trunk, [], []
        for k in range(1, (self.mtp_active_depth if run_depths is None else run_depths) + 1):
            length = T - k - 1
            h_in = previous[:, :length] if cfg.architecture == "cascaded" else trunk[:, :length]
            emb_in = embeddings[:, k : k + length] if embeddings is not None else None  # Emb(t(i+k))
            loss_spec = None
            if with_loss and k <= self.mtp_active_depth:
                targets = depth_targets(labels, k, length, position_ids, cfg.ignore_index)  # (B, L)
                # detach_trunk: the MTP loss must not move the shared head (scored with its weight detached)
                loss_spec = DepthLossSpec(self.mtp_depth_head_weight(k), targets,
                                          scale * self.mtp_depth_weights[k - 1], cfg.ignore_index,
                                          self._mtp_chunk_size(), self.mtp_depth_head(k),
                                          detach_head=cfg.detach_trunk and self.mtp_output_heads is None,
                                          normalizer=self._mtp_normalizer(k))
            positions = None if position_ids is None else position_ids[:, :length]  # (B, L)
            depth_mask = None if mask is None else mask[:, :, :length, :length]  # (B, 1, L, L)
            out, normed = run_depth(modules[k - 1], cos[:, :length], sin[:, :length], recompute, h_in, emb_in,
                                    positions, depth_mask)
            depth_hidden.append(normed)
            if k <= self.mtp_active_depth:
                specs.append(loss_spec)
            previous = out
        # Under detach_trunk, loss terms (callbacks) read the detached trunk state: no MTP-side gradient reaches it.
        return MTPForward(input_ids, labels, trunk, depth_hidden, position_ids=position_ids), specs

    def _check_trunk_hidden(self, hidden: Tensor, input_ids: Tensor) -> None:
        norm = getattr(self.mtp_modules[0], "norm", None)
        weight = getattr(norm, "weight", None)
        width = int(getattr(weight, "ds_shape", weight.shape)[0]) if weight is not None else None  # ZeRO-3: ds_shape
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(input_ids.shape) or (
            width is not None and hidden.shape[-1] != width
        ):
            raise ValueError(
                f"{type(self).__name__}.mtp_trunk_hidden_states(input_ids) (or the hidden states given to "
                f"compute_mtp_loss) must be (batch, tokens, hidden) = ({input_ids.shape[0]}, {input_ids.shape[1]}, "
                f"{width if width is not None else 'H'}) for input_ids of shape {tuple(input_ids.shape)}, got "
                f"{tuple(hidden.shape)}: return the trunk's last hidden state, one vector per token, before the final "
                "norm (not logits, not a pooled or flattened state)"
            )

    def _finish(self, fwd: MTPForward, parts: list[DepthLossPart], main: Optional[DepthLossPart]) -> MTPLossOutput:
        cfg = self.mtp_config
        losses = combine_parts(([main] if main is not None else []) + parts)
        per_depth = losses.per_depth[int(main is not None):]
        depth_losses = torch.zeros(cfg.depth, device=per_depth.device, dtype=per_depth.dtype)  # (not the default:
        # bf16-true makes it bfloat16, which rounded the logged per-depth losses)
        depth_losses[: per_depth.shape[0]] = per_depth
        mtp_weighted = per_depth.new_zeros(())
        for i, part in enumerate(parts):
            mtp_weighted = mtp_weighted + part.weight * per_depth[i]
        total = losses.loss
        extra = {}
        if torch.is_grad_enabled():
            if cfg.detach_trunk and fwd.main_hidden is not None:
                # The main loss was scored from it with gradient; the MTP-side terms read it detached.
                fwd = dataclasses.replace(fwd, main_hidden=fwd.main_hidden.detach())
            for name, term in self._mtp_loss_terms.items():
                extra[name] = term(self, fwd)
                total = total + extra[name]
        return MTPLossOutput(
            loss=total,
            mtp_loss=mtp_weighted.detach(),
            depth_losses=depth_losses,
            main_loss=losses.per_depth[0] if main is not None else None,
            extra_terms={k: v.detach() for k, v in extra.items()},
            forward=fwd,
            losses=losses,
        )

    def _mtp_chunk_size(self) -> Optional[int]:
        return self.mtp_config.loss_chunk_size

    def compute_mtp_loss(
        self, hidden: Tensor, input_ids: Tensor, labels: Optional[Tensor] = None, position_ids: Optional[Tensor] = None
    ) -> MTPLossOutput:
        """The weighted MTP loss for hosts that keep their own ``training_step``.

        Args:
            hidden: (B, T, H) the trunk's last hidden state (before the final norm); for a packed batch, computed
                with attention kept within each document.
            input_ids: (B, T) token ids.
            labels: (B, T) targets aligned with ``input_ids`` (``ignore_index`` where not trained: padding,
                prompts); default ``input_ids``. Position i of depth k is scored on ``labels[i+k+1]``.
            position_ids: (B, T) positions of a packed batch, restarting at 0 at each document (``None``: one
                sequence per row). Depths attend within documents, and targets in another document are not scored.

        Returns:
            ``loss`` = λ · mean_k(w_k · L_k) (+ registered terms) to add to the host's own loss, and
            ``depth_losses`` (D,) for logging.
        """
        check_loss_inputs(input_ids, labels, position_ids)
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
            raise ValueError(f"compute_mtp_loss: hidden must be the trunk's floating-point (B, T, H) states, got "
                             f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
        self.mtp_whole_root()
        with dtypes_named_on_failure(self, "compute_mtp_loss"):
            return self._score(*self._run_depths(hidden, input_ids, labels, with_loss=True, position_ids=position_ids))

    def compute_lm_loss(
        self, input_ids: Tensor, labels: Optional[Tensor] = None, position_ids: Optional[Tensor] = None
    ) -> MTPLossOutput:
        """Next-token loss plus the MTP loss; every depth's cross-entropy is chunked.

        ``labels`` (B, T): what each token is scored as (``ignore_index``: not scored; default ``input_ids``);
        the main head at i predicts ``labels[i+1]``, depth k ``labels[i+k+1]``. ``position_ids`` (B, T): a packed
        batch's positions, restarting at 0 at each document; the trunk receives them
        (:meth:`~lightning_mtp.mixin.contract.MTPHostContract.mtp_run_trunk`: a host that cannot take them refuses
        the batch) and no target crosses a document boundary.
        """
        check_loss_inputs(input_ids, labels, position_ids)
        self.mtp_whole_root()  # FSDP2: the shared embedding and head, whole for the trunk and every depth
        with dtypes_named_on_failure(self, "compute_lm_loss"):
            with TrunkEmbeddings.capture(self, input_ids) as trunk_embeddings:
                hidden = self.mtp_run_trunk(input_ids, position_ids)  # (B, T, H)
            fwd, specs = self._run_depths(hidden, input_ids, labels, with_loss=True,
                                          trunk_embeddings=trunk_embeddings, position_ids=position_ids)
            return self._score(fwd, specs, self._main_loss_spec(hidden, fwd))

    def _main_loss_spec(self, hidden: Tensor, fwd: MTPForward) -> DepthLossSpec:
        """The next-token head's loss spec; sets ``fwd.main_hidden`` (B, T-1, H), the final-normed trunk states."""
        fwd.main_hidden = self.mtp_final_norm()(hidden[:, :-1])  # (B, T-1, H)
        targets = fwd.targets(0, hidden.shape[1] - 1, self.mtp_config.ignore_index)  # (B, T-1)
        return DepthLossSpec(self.mtp_depth_head_weight(0), targets, 1.0, self.mtp_config.ignore_index,
                             self._mtp_chunk_size(), self.mtp_depth_head(0), normalizer=self._mtp_normalizer(0))

    def _mtp_normalizer(self, part: int) -> Optional[Tensor]:
        """What part ``part``'s (0: the main head, k: depth k) summed cross-entropy is divided by: the optimizer
        step's scored tokens while ``training_step`` runs (:mod:`~lightning_mtp.mixin.step_tokens`), else ``None``
        (the batch's own)."""
        normalizers = getattr(self, "_mtp_step_normalizers", None)
        return None if normalizers is None else normalizers[part]


class TrunkEmbeddings:
    """The output of the trunk's embedding lookup of ``input_ids``, caught while the trunk runs, for the cascaded
    depths to read.

    Depth k reads Emb(t(i+k)), a shifted window of the very lookup the trunk's first layer reads. Reusing it saves a
    second (B, T, H) lookup and its gradient accumulator in backward (the depths' d/dEmb then flows into the trunk's
    embedding output, one embedding backward for all). It is caught by a forward hook on the token embedding for the
    duration of :meth:`capture`, taken only from a call on ``input_ids`` (or a tensor equal to it), and refused
    (``get`` returns ``None``, so the depths look the tokens up again) when the host changed it in place afterwards,
    its shape is not (B, T, H) or it is an inference tensor (no version counter to tell); a trunk whose compiled
    graph skips the hook simply leaves nothing to reuse.
    """

    def __init__(self, input_ids: Tensor):
        self.input_ids = input_ids
        self.output: Optional[Tensor] = None
        self.version = -1

    def _hook(self, module: nn.Module, args: tuple, output) -> None:
        ids = args[0] if args else None
        if not isinstance(output, Tensor) or not isinstance(ids, Tensor) or output.is_inference():
            return  # an inference tensor has no version counter: an in-place change could not be told
        if ids is self.input_ids or (ids.shape == self.input_ids.shape and torch.equal(ids, self.input_ids)):
            self.output, self.version = output, output._version  # a view or copy of the ids (GPT-2 reshapes them)

    def get(self, shape: torch.Size) -> Optional[Tensor]:
        """The caught lookup (B, T, H) if it is intact and of ``shape``, else ``None``."""
        out = self.output
        if out is None or out._version != self.version or tuple(out.shape) != tuple(shape):
            return None
        return out

    @classmethod
    @contextlib.contextmanager
    def capture(cls, host, input_ids: Tensor) -> Iterator[Optional[TrunkEmbeddings]]:
        """Catch the trunk's lookup while the block runs; yields ``None`` where nothing would read it (a parallel
        architecture, or cascaded depths with an embedding of their own)."""
        if host.mtp_config.architecture != "cascaded" or host.mtp_draft_embedding() is not host.mtp_token_embedding():
            yield None
            return
        caught = cls(input_ids)
        handle = host.mtp_token_embedding().register_forward_hook(caught._hook)
        try:
            yield caught
        finally:
            handle.remove()


def check_token_ids(ids: Any, what: str) -> None:
    """Raise ``ValueError`` unless ``ids`` is a (B, T) integer tensor holding at least one token."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        shape = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{what} must be a (B, T) tensor of integer token ids, got {shape}")
    if ids.numel() == 0:
        raise ValueError(f"{what} hold no token (shape {tuple(ids.shape)}): a batch needs at least one row")


@contextlib.contextmanager
def dtypes_named_on_failure(module: Any, caller: str):
    """Let an error of the loss through, unless the MTP modules' dtype differs from the head's: then that refusal
    (:meth:`~lightning_mtp.mixin.construction.MTPConstruction.mtp_check_dtypes`) names the cause torch's own error
    ("expected m1 and m2 to have the same dtype") does not. Checked only on a failure: nothing is added to a step."""
    try:
        yield
    except (RuntimeError, ValueError):
        module.mtp_check_dtypes(caller)
        raise


def check_loss_inputs(input_ids: Any, labels: Any, position_ids: Any, what: str = "") -> None:
    """The checks of the loss API's arguments that need no host sync: shapes and dtypes (a batch through the default
    ``training_step`` is also checked for ids outside the vocabulary, :meth:`MTPSteps.mtp_checked_batch`). ``what``
    prefixes the names in the messages (``"a batch's "``)."""
    check_token_ids(input_ids, f"{what}input_ids")
    for name, value in (("labels", labels), ("position_ids", position_ids)):
        if value is None:
            continue
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(input_ids.shape):
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{what}{name} must have input_ids' shape {tuple(input_ids.shape)}, got {got}")
        if value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(f"{what}{name} must be integers, got {value.dtype}")
