"""Test helpers: tiny random-weight targets built with transformers, and EAGLE heads distilled on
them for a few seconds so that rounds accept several tokens.

The targets are "peaked" (embeddings x50, final norm x10) so their next-token distributions are
confident like a real LM's rather than near-uniform; nothing else about them is special.
"""

from __future__ import annotations

import torch

VOCAB = 128
HIDDEN = 64


def tiny_hf(arch: str = "llama", layers: int = 2, seed: int = 0, peaked: bool = True, **overrides):
    """A random-weight transformers model (fp32, eval). No EOS unless given, so generate() runs
    to max_new_tokens like aerie's --ignore-eos."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**kw)).eval()
    with torch.no_grad():
        if arch == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
        if peaked:
            model.model.embed_tokens.weight.mul_(50.0)
            model.model.norm.weight.mul_(10.0)
    return model


def to_native(hf_model, dtype: torch.dtype = torch.float32):
    """The same weights in aerie's TargetModel (loaded by name, strictly)."""
    from services.model.config import ModelConfig
    from services.model.target import TargetModel

    model = TargetModel(ModelConfig.from_hf_dict(hf_model.config.to_dict()))
    state = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    return model.to(dtype).eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    return out[0, len(prompt):].tolist()


def distill_head(target, kind: str, seed: int = 0, steps: int = 150, draft_vocab: int | None = None):
    """An EAGLE head trained briefly on the target's own greedy continuations."""
    from services.model.eagle_head import HeadConfig, build_head
    from services.model import draft_vocab as dv
    from services.train.distill import collect, head_loss

    g = torch.Generator().manual_seed(seed + 1)
    samples = [collect(target, torch.randint(0, VOCAB, (8,), generator=g).tolist(), 56,
                       want_taps=kind == "eagle3") for _ in range(32)]
    cfg = HeadConfig(kind, HIDDEN, 128, 4, 2, 1e-6, VOCAB,
                     draft_vocab_size=draft_vocab if kind == "eagle3" else None)
    torch.manual_seed(seed)
    head = build_head(cfg, target.lm_head)
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    if kind == "eagle3" and draft_vocab and draft_vocab < VOCAB:
        counts = torch.bincount(torch.cat([s.tokens for s in samples]), minlength=VOCAB)
        head.d2t, head.t2d = dv.d2t_t2d(dv.select(counts, draft_vocab), VOCAB)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    head.train()
    for i in range(steps):
        opt.zero_grad()
        for j in range(4):
            loss, _ = head_loss(head, samples[(4 * i + j) % len(samples)], steps=4)
            (loss / 4).backward()
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        sched.step()
    return head.eval().requires_grad_(False)


def reference_golden():
    """scripts/reference_golden.py as a module (seeded weights that are the same bits on every CPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "reference_golden.py"
    spec = importlib.util.spec_from_file_location("reference_golden", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seeded_pair(dtype: torch.dtype = torch.float32):
    """(native target, EAGLE-2 head) of scripts/reference_golden.py's greedy case: a peaked 3-layer
    Llama and a pass-through head, every weight drawn in float64 from seeded uniform draws and
    rounded to float32, so the bits are the same on every CPU (unlike `tiny_hf` + `distill_head`,
    whose initialisation and 150 training steps go through the CPU's kernels). Check
    `reference_golden().greedy_case_digest(GREEDY_CASE)` before pinning anything on it."""
    from services.model.config import ModelConfig
    from services.model.eagle_head import build_head
    from services.model.head_checkpoint import head_config_from_dict
    from services.model.target import TargetModel

    rg = reference_golden()
    case = rg.GREEDY_CASE
    tstate = rg.target_state(case["target"])
    target = TargetModel(ModelConfig.from_hf_dict(rg.target_config_dict(case["target"])))
    target.load_state_dict(tstate, strict=True)
    target = target.to(dtype).eval().requires_grad_(False)
    hstate = rg.greedy_head_state(case)
    # the published head has no embed_tokens.weight: loaders copy the target's (reference: load_emb)
    hstate["embed_tokens.weight"] = tstate["model.embed_tokens.weight"]
    head = build_head(head_config_from_dict(rg.greedy_head_config_dict(case), hstate), target.lm_head)
    head.load_state_dict(hstate, strict=True)
    return target, head.to(dtype).eval().requires_grad_(False)


def save_tiny_tokenizer(path, eos: str = "t2") -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" .. "t127", whitespace-separated), so
    commands that need text (train-draft, bench) run on the tiny targets."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=eos)
    fast.save_pretrained(str(path))


def tiny_text(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


def save_bench_dirs(pair, root):
    """The tiny (hf, native, head) pair as `root/target` (with the word-level tokenizer, eos "t127"),
    `root/head`, and `root/prompts.jsonl`: four Spec-Bench rows, categories writing and math."""
    import json

    from services.model.head_checkpoint import save_head

    hf, _, head = pair
    hf.save_pretrained(root / "target")
    save_tiny_tokenizer(root / "target", eos="t127")
    save_head(head, root / "head")
    rows = [{"question_id": i, "category": ["writing", "math"][i % 2], "turns": [tiny_text(i, 6), "x"]}
            for i in range(4)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def oracle(ref: list[int], hit: bool):
    """A guesser that knows the target's greedy text: the round's exact verdict (accepted path +
    bonus) when `hit`, else a first token the target will not commit."""
    def guess(tree, depth: int, produced: int) -> list[int]:
        if not hit:
            return [(ref[produced] + 1) % VOCAB]
        parents, toks = tree.parents.tolist(), tree.tokens.tolist()
        node, out = 0, []
        while True:
            want = ref[produced + len(out)]
            nxt = next((i for i in range(1, len(toks)) if parents[i] == node and toks[i] == want), None)
            out.append(want)
            if nxt is None:
                return out  # accepted drafts + the bonus
            node = nxt
    return guess


def gathered_attention(q, k, v, row_table, prefix, tree):
    """What the paged attention kernel must give, the default way: every sequence's key slots gathered
    from the arena (`row_table` [B, S]), then `attend_gathered` with `key_mask`.
    q [B, T, H, hd]; k, v [nKV, rows, hd]; prefix [B]; tree [B, T, T] -> [B, T, H, hd]."""
    from services.model.attention import attend_gathered
    from services.model.uniform import key_mask

    b, s = row_table.shape
    nkv, hd = k.shape[0], k.shape[2]
    keys = k.index_select(1, row_table.flatten()).view(nkv, b, s, hd)
    vals = v.index_select(1, row_table.flatten()).view(nkv, b, s, hd)
    mask = key_mask(prefix, tree.bool(), s)
    return attend_gathered(q.transpose(1, 2), keys, vals, mask).transpose(1, 2)


def require_triton():
    """The triton module for the paged attention kernel's tests. The `test` extra installs it on Linux,
    so there it missing is a broken setup (fail, naming the install); other platforms have no triton
    wheels (skip, saying so)."""
    import sys

    import pytest

    try:
        import triton
    except ImportError as e:
        if sys.platform.startswith("linux"):
            pytest.fail(f"triton is missing ({e}): the test extra installs it: pip install -e '.[test]'", pytrace=False)
        pytest.skip(f"triton has no wheels for {sys.platform}", allow_module_level=True)
    return triton


class InProcessPlainRun:
    """A run of plain steps over an in-process verifier's decode calls (DecodeRun's interface: the
    engine's run path without gRPC)."""

    def __init__(self, verifier, seq_id: str, token: int, round_index: int, steps: int, keep_features: bool) -> None:
        self.verifier, self.seq_id, self.token, self.round_index = verifier, seq_id, token, round_index
        self.left, self.keep_features = steps, keep_features

    def __next__(self) -> int:
        assert self.left > 0, "the engine read past its run"
        self.token = self.verifier.decode(self.seq_id, self.token, self.round_index, keep_features=self.keep_features)
        self.round_index, self.left = self.round_index + 1, self.left - 1
        return self.token

    def close(self) -> None:
        self.left = 0
