"""One SAO step on a real checkpoint (SmolLM2-135M-Instruct): tokens/s and
peak resident memory, against an analytic estimate; and what the same
formula predicts for Qwen3-0.6B and Qwen3-1.7B on one GPU.

The step: ``sao train`` in this process (embedded engine, CPU, ``--dtype``),
``train.steps = 1``, ``train.batch_size = 8`` episodes of up to 48-token
replies to "What is a + b?" questions, the SAO preset (critic with frozen
attention, DIS loss), no critic warm-up, one held-out episode. Peak memory is
``ru_maxrss`` of this process; the baseline is ``ru_maxrss`` after the imports,
before any model is loaded (the Python, torch and transformers runtime).

The estimate counts bytes per item, the formula of docs/gpu.md ("GPU
memory"): policy and critic weights in the model dtype, float32 master weights
(bf16 only), AdamW's two float32 moments for every trained parameter (the
critic's frozen attention has none), gradients of one model at a time, the
embedded engine's own weight copy and its KV cache, the activations autograd
keeps (measured here with saved-tensor hooks on one forward of the policy)
and the float32 logits of one chunk (the trainer's head runs 1024 positions
at a time; three such buffers live at once).

    PYTHONPATH=. python benchmarks/real_step_memory.py [--model DIR] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, Qwen3Config

from benchmarks._bench import QUIET
from sao.app.run import train
from sao.config import load_config
from sao.models.freeze import freeze_attention
from sao.models.loading import load_tokenizer
from sao.models.value import ValueModel

GIB = 2**30
QWEN3_SHARED = dict(  # config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B on the Hugging Face Hub
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip
QWEN3 = {
    "Qwen3-0.6B": Qwen3Config(**QWEN3_SHARED, hidden_size=1024, intermediate_size=3072),
    "Qwen3-1.7B": Qwen3Config(**QWEN3_SHARED, hidden_size=2048, intermediate_size=6144),
}
QWEN3_ACTIVATION_BYTES = {"Qwen3-0.6B": 71_848, "Qwen3-1.7B": 112_808}  # docs/gpu.md, bf16
INSTRUCTION = "Explain step by step, then give the number."
PROBLEMS = [(7, 5), (2, 3), (9, 4), (6, 8), (1, 1), (3, 4), (5, 5), (8, 2)]


def rss_gib() -> float:
    """Peak resident memory of this process so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def counts(cfg: PretrainedConfig) -> tuple[int, int, int]:
    """Parameters of the policy, of its critic, and the critic's trained ones
    (attention frozen), from shapes only (meta device)."""
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(cfg)
        critic = ValueModel.from_policy(policy)
    p = sum(x.numel() for x in policy.parameters())  # tied embeddings count once
    c = sum(x.numel() for x in critic.parameters())
    return p, c, freeze_attention(critic).num_trainable


def estimate(
    cfg: PretrainedConfig,
    dtype: str,
    *,
    slots: int,
    context: int,
    tokens: int,
    activation_bytes: float,
) -> dict[str, float]:
    """Bytes per item of one SAO step (docs/gpu.md's formula). ``slots`` x
    ``context``: the engine's KV cache; ``tokens``: one micro-batch;
    ``activation_bytes``: saved bytes per token and decoder layer."""
    p, c, ct = counts(cfg)
    w = 2 if dtype == "bfloat16" else 4
    master = 4 if dtype == "bfloat16" else 0  # a float32 parameter is its own master
    layers, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        f"policy weights ({dtype})": w * p,
        "policy fp32 masters (bf16 only) + AdamW m, v": (master + 8) * p,
        f"critic weights ({dtype})": w * c,
        "critic fp32 masters (bf16 only) + AdamW m, v": (master + 8) * ct,
        "gradients (one model at a time)": (w + master) * p,
        f"engine weights ({dtype})": w * p,
        "engine KV cache": 2 * layers * slots * kv * context * head_dim * w,
        "activations of one micro-batch": activation_bytes * layers * tokens,
        "fp32 logits of one chunk (x3)": 3 * min(tokens, 1024) * cfg.vocab_size * 4,
    }


def activation_bytes_per_token_layer(model_dir: str, dtype: torch.dtype, t: int = 96) -> float:
    """Bytes autograd saves for backward per token and decoder layer: one
    forward of the policy on ``t`` tokens under saved-tensor hooks, weights
    (parameters) not counted."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    params = {x.data_ptr() for x in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.data_ptr() not in params:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    ids = torch.randint(10, 40000, (1, t), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.model(input_ids=ids)  # the backbone; the head's logits are counted apart
    del model
    return sum(seen.values()) / (t * AutoConfig.from_pretrained(model_dir).num_hidden_layers)


def prompt_tokens(model_dir: str) -> int:
    """Tokens of one episode's prompt: the chat template (with SmolLM2's
    system message), the instruction and the question."""
    tok = load_tokenizer(model_dir)
    content = f"What is 7 + 5?\n{INSTRUCTION}"  # as sao.envs.dataset appends it
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return len(tok(text, add_special_tokens=False)["input_ids"])


def one_step(model_dir: str, dtype: str, run_dir: Path) -> dict[str, float]:
    """Run the SAO step; returns its last metrics row."""
    data = run_dir.parent / "add.jsonl"
    rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in PROBLEMS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [
        f"model.path={model_dir}", "model.device=cpu", f"model.dtype={dtype}",
        "task.name=dataset", f"task.options.train_path={data}", f"task.options.eval_path={data}",
        "task.options.prompt_key=problem", "task.options.scorer=exact",
        f"task.options.instruction={INSTRUCTION}",
        "rollout.max_new_tokens=48", "rollout.max_total_tokens=256", "rollout.max_batch_size=8",
        "rollout.in_flight=8", "algo.preset=sao", "algo.critic_pretrain_steps=0",
        "train.steps=1", "train.batch_size=8", "train.actor_lr=1e-6", "train.critic_lr=5e-6",
        "eval.episodes=1", "eval.every=100", f"log.run_dir={run_dir}", *QUIET,
    ]  # fmt: skip
    train(load_config(None, None, sets))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "actor/loss" in r][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("SAO_REAL_MODEL", ""))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    if not args.model:
        ap.error("--model: the SmolLM2 directory `sao models fetch smollm2-135m` prints")
    base = rss_gib()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        row = one_step(args.model, args.dtype, Path(tmp) / "run")
        wall = time.perf_counter() - t0
    peak = rss_gib()
    torch_dtype = getattr(torch, args.dtype)
    act = activation_bytes_per_token_layer(args.model, torch_dtype)
    cfg = AutoConfig.from_pretrained(args.model)
    action = 8 * row["train/action_tokens_mean"]  # the batch's reply tokens
    tokens = int(action) + 8 * prompt_tokens(args.model)  # prompt + reply, trained on
    est = estimate(cfg, args.dtype, slots=8, context=256, tokens=tokens, activation_bytes=act)
    p, c, ct = counts(cfg)
    print(f"SmolLM2-135M-Instruct, {args.dtype}, one SAO step (batch 8, <= 48-token replies)")
    print(f"  parameters: policy {p / 1e6:.1f}M, critic {c / 1e6:.1f}M ({ct / 1e6:.1f}M trained)")
    step_s = row["time/train_step_s"]
    print(
        f"  train step {step_s:.1f} s: {tokens} batch tokens ({action:.0f} of them replies), "
        f"{tokens / step_s:.0f} tokens/s"
    )
    print(
        f"  rollout+step: {row['throughput/tokens_per_s']:.0f} sampled tokens/s; run {wall:.0f} s"
    )
    print(f"  activations measured: {act:,.0f} bytes per token and layer")
    print(f"\n{'GiB':<46}{'estimate':>10}")
    for k, v in est.items():
        print(f"{k:<46}{v / GIB:>10.3f}")
    total = sum(est.values()) / GIB
    print(f"{'total estimate':<46}{total:>10.3f}")
    print(f"{'measured peak RSS - baseline':<46}{peak - base:>10.3f}")
    print(f"  (peak RSS {peak:.3f} GiB, baseline after imports {base:.3f} GiB; ratio "
          f"measured / estimate {(peak - base) / total:.2f})")  # fmt: skip
    print("\nthe same formula on one GPU, bf16, the recipe's sizes (docs/gpu.md: 64 slots x")
    print("4096 context, 8192-token micro-batches); GiB")
    cols = {
        name: estimate(cfg_q, "bfloat16", slots=64, context=4096, tokens=8192,
                       activation_bytes=QWEN3_ACTIVATION_BYTES[name])
        for name, cfg_q in QWEN3.items()
    }  # fmt: skip
    print(f"{'':<46}" + "".join(f"{n:>12}" for n in cols))
    for k in next(iter(cols.values())):
        print(f"{k:<46}" + "".join(f"{col[k] / GIB:>12.1f}" for col in cols.values()))
    print(f"{'total':<46}" + "".join(f"{sum(col.values()) / GIB:>12.1f}" for col in cols.values()))


if __name__ == "__main__":
    main()
