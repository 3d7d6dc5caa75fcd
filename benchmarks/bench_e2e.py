"""End to end: a whole transformer forward with and without make_torch_inplace.convert.

Models (random weights from configs, no download): GPT-2, BERT, Llama, Qwen2 and Gemma from
transformers (base models, no LM head), the T5 encoder (relative position bias: SDPA gets it as
an additive float mask) and a plain pre-norm attention block. Each runs with eager attention
(the scores materialised: B x heads x T x T) and with scaled_dot_product_attention, each as is
and converted: variants "eager", "eager+convert", "sdpa", "sdpa+convert". Inference in bf16
under torch.inference_mode, batch 1 at seq 512 ... 8192 plus batch 4 at the short ones.

Per case: median latency, peak memory above the weights and inputs (the output included),
and the largest difference of the converted model's output from the unconverted one's.
The goals printed at the end: eager+convert peak <= 0.5x eager at seq >= 4096 with latency
<= 1.1x; every converted model never worse: peak <= 1.0x and latency <= 1.05x of the model as
is, on every row.

    python benchmarks/bench_e2e.py                 # full sweep, CUDA (a few minutes)
    python benchmarks/bench_e2e.py --quick         # Llama, seq 512 and 1024
    python benchmarks/bench_e2e.py --tiny --device cpu   # code-path check with tiny configs

Writes benchmarks/results/<gpu>/e2e.json, e2e.md, e2e_peak.png, e2e_latency.png.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.common import (
    DEFAULT_REP_MS,
    best_device,
    earlier_records,
    env_info,
    fmt_bytes,
    markdown_table,
    peak_extra_bytes,
    plot_grid,
    results_dir,
    time_ms,
    write_results,
)

MODELS = ["gpt2", "bert", "llama", "qwen2", "gemma", "t5", "block"]
SEQS = [512, 1024, 2048, 4096, 8192]
QUICK_SEQS = [512, 1024]
EXTRA_BATCH = 4  # also run at batch 4 for seq <= EXTRA_BATCH_MAX_SEQ
EXTRA_BATCH_MAX_SEQ = 1024
VARIANTS = ["eager", "eager+convert", "sdpa", "sdpa+convert"]
ATTNS = ["eager", "sdpa"]
VOCAB = 32000


@dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    layers: int
    max_seq: int


# hidden 2048 with 16 heads of 128: eager attention at seq 8192 holds 2 GiB per bf16 score
# tensor (up to 3 at once in eager Llama), well inside 80 GB.
FULL = Size(hidden=2048, heads=16, layers=4, max_seq=8192)
TINY = Size(hidden=64, heads=4, layers=2, max_seq=128)


# --------------------------------------------------------------------------- models


class PreNormBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); the mask is an additive causal mask."""

    def __init__(self, size: Size, attn: str):
        super().__init__()
        d = size.hidden
        self.heads, self.attn = size.heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.attn == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5 + mask
            o = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        x = x + self.proj(o.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LastHiddenState(nn.Module):
    """A transformers base model as a function of input_ids -> last_hidden_state."""

    def __init__(self, model: nn.Module, kwargs: dict):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, **self.kwargs).last_hidden_state


def build(name: str, attn: str, size: Size, device, dtype) -> nn.Module:
    torch.manual_seed(0)
    if name == "block":
        with torch.device(device):
            return PreNormBlock(size, attn).to(dtype).eval()
    import transformers

    transformers.logging.set_verbosity_error()
    d, heads, layers = size.hidden, size.heads, size.layers
    common = dict(vocab_size=VOCAB, attn_implementation=attn)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=d, n_head=heads, n_layer=layers, n_positions=size.max_seq, **common
        )
        cls = transformers.GPT2Model
    elif name == "bert":
        config = transformers.BertConfig(
            hidden_size=d,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=4 * d,
            max_position_embeddings=size.max_seq,
            **common,
        )
        cls = transformers.BertModel
    elif name == "t5":
        config = transformers.T5Config(
            d_model=d,
            d_kv=d // heads,
            num_heads=heads,
            num_layers=layers,
            d_ff=4 * d,
            **common,
        )
        cls = transformers.T5EncoderModel
    else:  # decoders with grouped-query attention, RMSNorm, rotary positions and a gated MLP
        cls, config_cls = {
            "llama": (transformers.LlamaModel, transformers.LlamaConfig),
            "qwen2": (transformers.Qwen2Model, transformers.Qwen2Config),
            "gemma": (transformers.GemmaModel, transformers.GemmaConfig),
        }[name]
        config = config_cls(
            hidden_size=d,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            head_dim=d // heads,
            num_hidden_layers=layers,
            intermediate_size=11 * d // 4,
            max_position_embeddings=size.max_seq,
            **common,
        )
    with torch.device(device):
        model = cls(config)
    # T5's encoder takes no use_cache (it keeps no cache).
    kwargs = {} if name == "t5" else {"use_cache": False}
    return LastHiddenState(model.to(dtype).eval(), kwargs)


def make_inputs(name: str, batch: int, seq: int, size: Size, device, dtype) -> tuple:
    g = torch.Generator().manual_seed(seq * 31 + batch)
    if name != "block":
        return (torch.randint(0, VOCAB, (batch, seq), generator=g).to(device),)
    x = torch.randn(batch, seq, size.hidden, generator=g).to(device, dtype)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = torch.zeros(seq, seq).masked_fill(~causal, torch.finfo(dtype).min)
    return x, mask.to(device, dtype)[None, None]


# --------------------------------------------------------------------------- measuring


# Timing rounds per case: the model as is and converted take turns, each round a time_ms of
# each (the same total time, split). A model this small at batch 1 is bound by its host time,
# which follows the host's speed, and that drifts between consecutive measurements; taking
# turns exposes both variants to the same drift, and the median over the rounds drops the
# rounds it hit, as long as a drift lasts fewer than half of them.
ROUNDS = 15


def measure_pair(fns: list[Callable[[], torch.Tensor]], device) -> list[tuple]:
    """(output, median ms, peak bytes) of each fn, timed in ROUNDS alternating rounds."""
    outs = [fn() for fn in fns]  # compiles (converted models) outside the measurements
    peaks = [peak_extra_bytes(fn, device=device) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(ROUNDS):
        for fn, ts in zip(fns, times):
            ts.append(time_ms(fn, device=device, warmup_ms=5.0, rep_ms=DEFAULT_REP_MS / ROUNDS))
    return [(out, statistics.median(ts), peak) for out, ts, peak in zip(outs, times, peaks)]


def run_model(name: str, seqs: list[int], size: Size, device, dtype, env) -> list[dict]:
    records = []
    for attn in ATTNS:
        model = build(name, attn, size, device, dtype)
        converted = mti.convert(model)
        cases = [(1, s) for s in seqs]
        cases += [(EXTRA_BATCH, s) for s in seqs if s <= EXTRA_BATCH_MAX_SEQ]
        for batch, seq in cases:
            inputs = make_inputs(name, batch, seq, size, device, dtype)
            variants = ((attn, model), (f"{attn}+convert", converted))

            def call(module, inputs=inputs):
                with torch.inference_mode():
                    return module(*inputs)

            results = measure_pair([functools.partial(call, m) for _, m in variants], device)
            base = results[0][0]
            for (variant, _), (out, ms, peak) in zip(variants, results):
                diff = (out.float() - base.float()).abs().max().item()
                rec = dict(
                    bench="e2e",
                    model=name,
                    variant=variant,
                    seq=seq,
                    batch=batch,
                    dtype=str(dtype).removeprefix("torch."),
                    ms=ms,
                    peak_bytes=peak,
                    max_abs_diff=diff,
                    **env,
                )
                records.append(rec)
                print(
                    f"{name:6s} {variant:14s} b={batch} T={seq:<5d} {ms:9.3f} ms  "
                    f"peak {fmt_bytes(peak):>10s}  max|diff| {diff:.3g}",
                    flush=True,
                )
            del results, out
            del base, inputs
        del model, converted
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


# --------------------------------------------------------------------------- report


def with_ratios(records: list[dict]) -> list[dict]:
    """Each converted record with its latency and peak relative to the unconverted one."""
    base = {(r["model"], r["variant"], r["seq"], r["batch"]): r for r in records}
    rows = []
    for r in records:
        row = dict(r, peak=fmt_bytes(r["peak_bytes"]))
        if r["variant"].endswith("+convert"):
            b = base[(r["model"], r["variant"].removesuffix("+convert"), r["seq"], r["batch"])]
            row["ms_ratio"] = r["ms"] / b["ms"]
            row["peak_ratio"] = r["peak_bytes"] / b["peak_bytes"] if b["peak_bytes"] else None
        rows.append(row)
    return rows


def goals(rows: list[dict]) -> list[str]:
    """The issue's targets: one line per model and attention. Latency is checked on every
    row, peak memory on the rows of seq >= the goal's minimum (every batch)."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for variant, min_seq, max_peak, max_ms, strict in (
            ("eager+convert", 4096, 0.5, 1.1, False),
            ("sdpa+convert", 0, 1.0, 1.05, True),
        ):
            sel = [r for r in rows if r["model"] == model and r["variant"] == variant]
            if not sel:
                continue
            peaks = [r["peak_ratio"] for r in sel if r["seq"] >= min_seq]
            worst_peak = max(peaks, default=0.0)
            worst_ms = max(r["ms_ratio"] for r in sel)
            peak_ok = worst_peak < max_peak if strict else worst_peak <= max_peak
            ok = "PASS" if peak_ok and worst_ms <= max_ms else "FAIL"
            lines.append(
                f"{ok} {model} {variant}: peak ratio <= {worst_peak:.3f} at seq >= {min_seq} "
                f"(goal {'<' if strict else '<='} {max_peak}), latency ratio <= {worst_ms:.3f} "
                f"(goal <= {max_ms})"
            )
        # Never worse: every converted row, whatever its attention, batch and length.
        sel = [r for r in rows if r["model"] == model and r["variant"].endswith("+convert")]
        if sel:
            worst_peak = max(r["peak_ratio"] or 0.0 for r in sel)
            worst_ms = max(r["ms_ratio"] for r in sel)
            ok = "PASS" if worst_peak <= 1.0 and worst_ms <= 1.05 else "FAIL"
            lines.append(
                f"{ok} {model} never worse: peak ratio <= {worst_peak:.3f} (goal <= 1.0), "
                f"latency ratio <= {worst_ms:.3f} (goal <= 1.05) on every converted row"
            )
    return lines


def report(records: list[dict]) -> None:
    rows = with_ratios(records)
    columns = [
        "model",
        "variant",
        "batch",
        "seq",
        "ms",
        "ms_ratio",
        "peak",
        "peak_ratio",
        "max_abs_diff",
    ]
    table = markdown_table(rows, columns)
    goal_lines = goals(rows)
    md = table + "\nGoals:\n\n" + "".join(f"- {g}\n" for g in goal_lines)
    print("\n" + md)
    json_path, md_path = write_results("e2e", records, md)
    out = results_dir()
    for key, ylabel, png in (
        ("peak_bytes", "peak MiB", "e2e_peak.png"),
        ("ms", "ms", "e2e_latency.png"),
    ):
        panels = []
        for model in dict.fromkeys(r["model"] for r in records):
            series = {
                v: [
                    (r["seq"], r[key] / (2**20 if key == "peak_bytes" else 1))
                    for r in records
                    if r["model"] == model and r["variant"] == v and r["batch"] == 1
                ]
                for v in VARIANTS
            }
            panels.append((f"{model} (batch 1)", series))
        plot_grid(out / png, panels, "sequence length", ylabel, ncols=len(panels))
    print(f"wrote {json_path}, {md_path}, {out / 'e2e_peak.png'}, {out / 'e2e_latency.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Llama only, seq 512 and 1024")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny configs and seq 32/64/128: a code-path check (e.g. on CPU)",
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None)
    parser.add_argument("--seqs", nargs="+", type=int, default=None)
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the other models' records of e2e.json when they are of this commit and device "
        "(a sweep run in parts)",
    )
    args = parser.parse_args()

    device = torch.device(args.device) if args.device else best_device()
    size = TINY if args.tiny else FULL
    models = args.models or (["llama"] if args.quick else MODELS)
    seqs = args.seqs or ([32, 64, 128] if args.tiny else QUICK_SEQS if args.quick else SEQS)
    if max(seqs) > size.max_seq:
        parser.error(f"seq {max(seqs)} exceeds the configs' max_seq {size.max_seq}")
    dtype = torch.bfloat16
    env = env_info()
    print(f"{env['device']}, torch {env['torch']}, commit {env['commit']}")
    records = earlier_records("e2e", env, lambda r: r["model"] not in models) if args.append else []
    for name in models:
        records += run_model(name, seqs, size, device, dtype, env)
        report(records)  # after each model: a sweep cut short keeps what it measured


if __name__ == "__main__":
    main()
