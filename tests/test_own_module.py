"""The README's "Add MTP to your own module" example, run as written: it trains, then decodes losslessly.

The code blocks are read from README.md at test time (never copied here) and the module is built at test sizes through
its own constructor arguments. Without a cache of its own it decodes through ``UncachedHost``; the README's cached
``MyLMHost`` must decode the same tokens. A causal transformer trunk without any attention-mask argument checks that
right padding and stale drafts never reach a real position.

References are independent of the decoder: greedy tokens are the argmax of the module's full forward re-run over the
row alone at every step; sampled tokens are compared with the exact distribution enumerated over a vocabulary of 16
(the chi-square and 6σ + 5 checks of ``test_decoding_sampling``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from test_decoding_sampling import check_counts
from torch import nn
from torch.utils.data import DataLoader

from lightning_mtp import MTPConfig, MTPMixin
from lightning_mtp.decoding import decoding_host, logits_to_probs
from lightning_mtp.decoding.uncached_host import UncachedHost

README = Path(__file__).resolve().parents[1] / "README.md"
VOCAB = 16
DIM = 32


def readme_example() -> dict:
    """The namespace left by running every Python block of the README's "Add MTP to your own module", in order."""
    section = README.read_text().split("## Add MTP to your own module\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "expected the module and its cached host"
    namespace: dict = {"__name__": "readme_example"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md (own-module block {i})", "exec"), namespace)
    return namespace


def fibonacci_windows(rows: int, length: int, seed: int) -> torch.Tensor:
    """(rows, length) sequences t(i+1) = t(i) + t(i-1) mod VOCAB: learnable, and the drafts are right only sometimes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(rows, length, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (rows, 2), generator=gen)
    for i in range(2, length):
        x[:, i] = (x[:, i - 1] + x[:, i - 2]) % VOCAB
    return x


def quiet_trainer(steps: int) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(scope="module")
def example():
    """The README's classes and a MyLM trained for 40 steps at vocabulary 16, width 32."""
    namespace = readme_example()
    torch.manual_seed(0)
    model = namespace["MyLM"](vocab_size=VOCAB, dim=DIM, lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes about the CPU run and missing validation data
        quiet_trainer(40).fit(model, DataLoader(fibonacci_windows(1280, 16, seed=0), batch_size=32, shuffle=True))
    return namespace, model.eval()


# ----------------------------------------------------------------------------------------------- references
def main_logits(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) next-token logits of the module's full forward, as its training loss computes them."""
    hidden = module.mtp_trunk_hidden_states(input_ids)  # (B, T, H)
    return module.mtp_logit_transform()(module.mtp_output_head()(module.mtp_final_norm()(hidden)))


@torch.no_grad()
def naive_greedy(module: nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy decoding of one prompt by re-running the full forward over everything so far at every step."""
    ids = prompt.unsqueeze(0)  # (1, P)
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, main_logits(module, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.numel():].tolist()


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) input ids and attention mask with every prompt right-aligned (left padding)."""
    width = max(p.numel() for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - prompt.numel():] = prompt
        mask[row, width - prompt.numel():] = 1
    return input_ids, mask


def rows_of(out) -> list[list[int]]:
    return [out.new_tokens[row, : out.num_new_tokens[row]].tolist() for row in range(out.new_tokens.shape[0])]


def ragged_prompts(seed: int) -> list[torch.Tensor]:
    windows = fibonacci_windows(3, 9, seed)
    windows[1] = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(seed))  # off the pattern
    return [windows[0, :5], windows[1, :2], windows[2, :9]]


def assert_lossless_greedy(module: nn.Module, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple:
    """Speculative greedy (every draft length) == plain greedy == the naive reference, for a left-padded ragged
    batch; returns the plain and the speculative output."""
    input_ids, mask = left_padded(prompts)
    plain = module.generate(input_ids, max_new_tokens, attention_mask=mask, speculative=False)
    speculative = module.generate(input_ids, max_new_tokens, attention_mask=mask, speculative=True)
    reference = [naive_greedy(module, prompt, max_new_tokens) for prompt in prompts]
    assert rows_of(plain) == reference
    assert rows_of(speculative) == reference
    assert rows_of(module.generate(input_ids, max_new_tokens, attention_mask=mask)) == reference  # "auto"
    for draft_tokens in range(1, module.mtp_config.depth):
        assert rows_of(module.generate(input_ids, max_new_tokens, attention_mask=mask,
                                       draft_tokens=draft_tokens)) == reference
    return plain, speculative


# ----------------------------------------------------------------------------------------------- the README module
def test_readme_example_trains(example):
    _, model = example
    assert model.mtp_modules is not None and len(model.mtp_modules) == 3
    with torch.no_grad():
        batch = fibonacci_windows(64, 16, seed=9)
        accuracy = (main_logits(model, batch)[:, 1:-1].argmax(-1) == batch[:, 2:]).float().mean()
    assert accuracy > 0.5  # the trunk learned the rule (chance: 1/16)


def test_readme_example_decodes_losslessly_without_a_cache(example):
    _, model = example
    assert isinstance(decoding_host(model), UncachedHost)
    plain, speculative = assert_lossless_greedy(model, ragged_prompts(seed=1), max_new_tokens=14)
    stats = speculative.stats
    assert 0 < sum(stats.accepted_per_depth) < sum(stats.drafted_per_depth)  # drafts accepted and rejected
    assert stats.main_forwards < plain.stats.main_forwards


def test_uncached_sampling_keeps_the_distribution(example):
    """12288 rows of one prompt, 3 tokens, temperature 1 and top-k 8: speculative and plain sampling through the
    uncached host both match the enumerated marginals of the first three tokens."""
    _, model = example
    prompt = torch.tensor([[5, 2, 7, 9, 0]])
    rows = 12288
    with torch.no_grad():
        first = logits_to_probs(main_logits(model, prompt)[0, -1], 1.0, 8).double()  # (V,)
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (V², 2)
        logits = main_logits(model, torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], dim=1))  # (V², 7, V)
        second = logits_to_probs(logits[:, -2], 1.0, 8).double().view(VOCAB, VOCAB, VOCAB)[:, 0]  # (x1, x2)
        third = logits_to_probs(logits[:, -1], 1.0, 8).double().view(VOCAB, VOCAB, VOCAB)  # (x1, x2, x3)
    marginals = [first, first @ second, torch.einsum("a,ab,abc->c", first, second, third)]
    for speculative in (True, False):
        out = model.generate(prompt.expand(rows, -1), 3, temperature=1.0, top_k=8, speculative=speculative, seed=0)
        if speculative:
            assert out.stats.accepted_per_depth[0] > 0.2 * rows
        for i, probs in enumerate(marginals):
            check_counts(torch.bincount(out.new_tokens[:, i], minlength=VOCAB), probs, f"{speculative=} token {i}")


def uncached_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "without a KV cache" in str(w.message)]


def test_readme_cached_host_decodes_the_same_tokens(example):
    namespace, model = example
    cached = namespace["MyCachedLM"](vocab_size=VOCAB, dim=DIM)
    cached.configure_model()
    cached.load_state_dict(model.state_dict())
    cached.eval()
    host = decoding_host(cached)
    assert type(host).__name__ == "MyLMHost"
    # the same hidden states as the uncached host, at ragged per-row positions and after a rollback
    uncached = UncachedHost(model)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    states = [h.allocate(2, 16) for h in (host, uncached)]
    with torch.no_grad():
        for h, state in zip((host, uncached), states):
            h.forward(tokens[:, :6], torch.arange(6).expand(2, 6), state)
            h.rollback(state, torch.tensor([3, 5]))
        positions = torch.tensor([[3, 4, 5, 6], [5, 6, 7, 8]])
        hidden = [h.forward(tokens.gather(1, positions), positions, s) for h, s in zip((host, uncached), states)]
    torch.testing.assert_close(hidden[0], hidden[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, speculative = assert_lossless_greedy(cached, ragged_prompts(seed=2), max_new_tokens=14)
    assert not uncached_warnings(caught)  # a host with a cache is not told to get one
    assert sum(speculative.stats.accepted_per_depth) > 0


def test_uncached_warning_is_shown_once_per_class(example):
    namespace, model = example
    fresh = type("FreshLM", (namespace["MyLM"],), {})(vocab_size=VOCAB, dim=DIM)
    fresh.configure_model()
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.warns(UserWarning, match=r"FreshLM decodes without a KV cache.*mtp_decoding_host\(\)"):
        fresh.generate(prompt, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.generate(prompt, 2)
    assert not uncached_warnings(caught)


def test_uncached_host_refuses_compile(example):
    _, model = example
    with pytest.raises(ValueError, match=r"compile .*--model\.generation\.compile.*UncachedHost"):
        model.generate(torch.tensor([[1, 2, 3]]), 2, compile=True)


def test_module_without_the_mixin_contract_cannot_decode():
    from lightning_mtp.decoding import generate

    with pytest.raises(TypeError, match="cannot decode.*mtp_decoding_host"):
        generate(nn.Linear(2, 2), torch.tensor([[1, 2]]), 2)


# ----------------------------------------------------------------------------------------------- an attention trunk
class CausalTransformerLM(MTPMixin, L.LightningModule):
    """A host whose trunk is causal attention with learned positions and no attention-mask argument."""

    def __init__(self, max_len: int = 40) -> None:
        super().__init__(mtp=MTPConfig(depth=2, num_heads=4))
        self.max_len = max_len
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(max_len, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.trunk = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def mtp_token_embedding(self):
        return self.embed

    def mtp_output_head(self):
        return self.head

    def mtp_final_norm(self):
        return self.norm

    def mtp_trunk_hidden_states(self, input_ids):
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.positions.weight[:length]  # (B, T, H)
        causal = nn.Transformer.generate_square_subsequent_mask(length)
        return self.trunk(x, mask=causal, is_causal=True)

    def mtp_max_sequence_length(self):
        return self.max_len


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(3)
    model = CausalTransformerLM()
    model.configure_model()
    with torch.no_grad():
        model.head.weight.mul_(8.0)  # decisive logits: no near-ties for float noise to flip
    return model.eval()


def test_uncached_host_hidden_states_equal_each_row_alone(transformer):
    """Rows at different positions, padding and stale drafts in the buffer: each real position is exact."""
    host = UncachedHost(transformer)
    tokens = torch.randint(0, VOCAB, (3, 14), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([4, 9, 1])
    state = host.allocate(3, 20)
    with torch.no_grad():
        host.forward(tokens[:, :9], torch.arange(9).expand(3, 9), state)  # prefill: rows 0 and 2 right-padded
        host.rollback(state, lengths)
        positions = lengths.unsqueeze(1) + torch.arange(4)  # (3, 4) each row from its own length
        hidden = host.forward(tokens.gather(1, positions), positions, state)  # (3, 4, H)
        for row in range(3):
            end = int(positions[row, -1]) + 1
            alone = transformer.mtp_trunk_hidden_states(tokens[row : row + 1, :end])[0, int(lengths[row]) :]
            torch.testing.assert_close(hidden[row], alone, atol=1e-5, rtol=1e-5)


def test_attention_trunk_decodes_losslessly(transformer):
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9]), torch.tensor([2, 6, 5, 3, 5, 8, 9, 7])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_lossless_greedy(transformer, prompts, max_new_tokens=12)


def test_uncached_context_leaves_room_for_verification(transformer):
    """prompt + new tokens ≤ the trunk's positions - D: the verify window stays inside the position table."""
    host = UncachedHost(transformer)
    assert host.max_context == 40 - 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = transformer.generate(torch.tensor([[1, 2, 3]]), 35)  # exactly fills the context
        assert out.num_new_tokens.tolist() == [35]
        with pytest.raises(ValueError, match="exceeds the model's context of 38"):
            transformer.generate(torch.tensor([[1, 2, 3]]), 36)


# ----------------------------------------------------------------------------------------------- DeepSpeed ZeRO-3
@pytest.mark.slow
@pytest.mark.distributed
def test_uncached_host_decodes_in_lockstep_under_zero3(tmp_path):
    """2 CPU processes, ZeRO-3: ranks with different prompts and budgets run the same number of trunk forwards (each
    all-gathers the parameters; finished ranks pad) and every rank's tokens equal the naive reference."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": str(README.parent), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["speculative"]["tokens"] == rank["plain"]["tokens"] == rank["reference"]
    for mode in ("speculative", "plain"):
        assert ranks[0][mode]["main_forwards"] == ranks[1][mode]["main_forwards"]  # lockstep
    assert ranks[0]["speculative"]["main_forwards"] < ranks[0]["plain"]["main_forwards"]


class TrainableTransformerLM(CausalTransformerLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run_zero3(out: Path) -> None:
    """The two-process run of :func:`test_uncached_host_decodes_in_lockstep_under_zero3` (Lightning starts rank 1)."""
    import deepspeed

    from lightning_mtp.strategies import CPUDeepSpeedStrategy

    warnings.simplefilter("ignore")
    common = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, strategy=CPUDeepSpeedStrategy(stage=3))
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=3, use_distributed_sampler=False, **common)
    trainer.fit(TrainableTransformerLM(), DataLoader(fibonacci_windows(64, 16, seed=0), batch_size=8))
    module, rank = trainer.lightning_module, trainer.global_rank
    prompts = [fibonacci_windows(1, 7, 10 + rank)[0, : 3 + 2 * rank], fibonacci_windows(1, 7, 20 + rank)[0, :5]]
    input_ids, mask = left_padded(prompts)
    rows = [{"input_ids": input_ids[row], "attention_mask": mask[row]} for row in range(len(prompts))]
    budget = 10 + 6 * rank  # rank 0 finishes first and pads
    record = {}
    for mode in ("speculative", "plain"):
        module.mtp_generate_kwargs = {"max_new_tokens": budget, "speculative": mode == "speculative"}
        (prediction,) = trainer.predict(module, DataLoader(rows, batch_size=len(rows)))
        record[mode] = {"tokens": prediction["tokens"], "main_forwards": prediction["stats"].main_forwards}
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        state = {name: param.detach().clone() for name, param in params.items()}
    reference = CausalTransformerLM()
    reference.configure_model()
    reference.load_state_dict(state)
    record["reference"] = [naive_greedy(reference.eval(), prompt, budget) for prompt in prompts]
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import deepspeed.comm.torch

    deepspeed.comm.torch.build_shm_op = lambda: None  # plain gloo collectives; skip the shared-memory op's C++ build
    run_zero3(Path(sys.argv[1]))


def test_a_checkpoint_rebuilds_the_readme_module_from_its_path_alone(example, tmp_path):
    """The README's module saves its hyperparameters, so ``load_from_checkpoint`` (and ``predict --ckpt_path``) build
    it at the trained sizes, not the defaults (vocabulary 32000, width 512), and decode as the trained module does."""
    namespace, model = example
    trainer = quiet_trainer(0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "mylm.ckpt")
    restored = namespace["MyLM"].load_from_checkpoint(tmp_path / "mylm.ckpt").eval()
    assert restored.embed.num_embeddings == VOCAB and restored.head.in_features == DIM
    prompt = torch.tensor([[1, 2, 3, 5]])
    assert restored.generate(prompt, 8, speculative=True).new_tokens.tolist() == \
        model.generate(prompt, 8, speculative=False).new_tokens.tolist()
