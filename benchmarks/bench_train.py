"""Training step: peak memory, step time, loss and gradients of HF models, as is and converted.

One step = forward with labels (the model computes its loss, as the HF Trainer calls it) +
backward + AdamW step (fused on CUDA: Hugging Face's Trainer default with torch >= 2.8, which
holds no temporaries of the parameters' size) + zero_grad(set_to_none=True); batch 1, bf16
weights (fp32 on the CPU),
random weights from configs (no download), dropout off so that every variant computes the same
function. Models, all with vocabulary 32000 and positions up to 8192:

- llama: LlamaForCausalLM, 4 layers, hidden 2048, intermediate 5632, 16 heads (no grouping of
  keys and values); the anchors of issue 60.
- llama-lora: the same Llama fine-tuned LoRA-style: every weight frozen, rank-16 adapters
  (alpha 32) on q_proj and v_proj (LoRALinear below).
- gpt2: GPT2LMHeadModel, 4 layers, n_embd 2048, 16 heads, MLP 8192 (284M parameters against
  Llama's 337M; the LM head is tied to the embedding, as in GPT-2).
- bert: BertForMaskedLM, 4 layers, hidden 2048, 16 heads, intermediate 8192 (288M
  parameters); 15% of the positions masked and predicted.

Variants: eager (HF eager attention), sdpa (HF scaled_dot_product_attention: the reference,
always run), compile (torch.compile of the SDPA model), liger (Liger-Kernel's
apply_liger_kernel_to_llama on the SDPA model: Llama only; skipped with the reason elsewhere
or where liger_kernel does not import), convert (mti.convert of the SDPA model),
convert-nologits (mti.convert(model, drop_outputs=("logits",)): no logits returned, as Liger's
fused linear cross entropy in training), convert-recompute (the same with
recompute=("mlp",): a SwiGLU MLP's gate and up projections computed again in the backward;
as convert-nologits on GPT-2 and BERT) and convert+compile
(torch.compile(mti.convert(model)): the converted module is a graph break for the outer
compile, so it runs as convert). A variant that raises (OOM, a refusal, a
compile error) is recorded with "error" and the sweep goes on.

Per model and sequence length, every variant is built from the same seed and trained on the
same batch. Fields of each record (pass "train_step"):
- max_grad_diff: the largest |gradient - the sdpa model's gradient| after the first step's
  backward (identical weights and data); max_grad_ref: the largest |gradient| of sdpa's.
- loss: the loss the 3rd step computes; loss_after_steps: the loss the loss_steps-th step
  computes (--loss-steps, default 20: the issue's loss-parity goal).
- peak_extra_bytes (CUDA): max_memory_allocated during one step, above what was allocated
  before it (weights, optimizer state, grads as None); None on the CPU. fwd_bwd_peak_bytes:
  the same for the forward and backward alone (where it is lower, the optimizer step, with
  the gradients and AdamW's temporaries, sets the step's peak).
- step_ms: the variants' steps timed in turns (common.time_alternating: each turn starts one
  variant later), the mean over places of the median at each place (place_median); CUDA
  events, or perf_counter on the CPU. All variants of a model and length stay alive together
  for this; between lengths and models everything is freed.

    python benchmarks/bench_train.py                      # full sweep, CUDA
    python benchmarks/bench_train.py --models llama --seq 4096
    python benchmarks/bench_train.py --tiny               # code-path check (the CPU's default)

Writes benchmarks/results/<gpu>/train.json, train.md (tables and the issue's goals) and
train_peak.png (peak against sequence length per model; skipped without matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.common import (
    best_device,
    earlier_records,
    env_info,
    fmt_bytes,
    markdown_table,
    peak_extra_bytes,
    place_median,
    plot_grid,
    results_dir,
    time_alternating,
    write_results,
)

MODELS = ["llama", "llama-lora", "gpt2", "bert"]
VARIANTS = [
    "eager",
    "sdpa",
    "compile",
    "liger",
    "convert",
    "convert-nologits",
    "convert-recompute",
    "convert+compile",
]
REFERENCE = "sdpa"
OURS = ("convert", "convert-nologits", "convert-recompute", "convert+compile")
# mti.convert's options in each converted variant (convert+compile: convert's, compiled).
CONVERT_OPTIONS = {
    "convert": {},
    "convert-nologits": {"drop_outputs": ("logits",)},
    "convert-recompute": {"drop_outputs": ("logits",), "recompute": ("mlp",)},
    "convert+compile": {},
}
SEQS = [2048, 4096, 8192]
TINY_SEQS = [64]
LORA_RANK, LORA_ALPHA = 16, 32.0
MLM_FRACTION = 0.15
# The goal, at seq >= GOAL_MIN_SEQ: our peak <= PEAK_GOAL x the lowest peer's, our
# step <= STEP_GOAL x the fastest peer's (peers: every variant but ours).
GOAL_MIN_SEQ, PEAK_GOAL, STEP_GOAL = 4096, 0.85, 1.05

# Every field of a record besides env_info's and the case's; None where not measured.
MEASURED = (
    "peak_extra_bytes",
    "fwd_bwd_peak_bytes",
    "step_ms",
    "loss",
    "loss_steps",
    "loss_after_steps",
    "max_grad_diff",
    "max_grad_ref",
    "error",
    "skipped",
)


@dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    layers: int
    intermediate: int  # Llama's gated MLP; GPT-2 and BERT use 4 x hidden
    vocab: int
    max_seq: int


FULL = Size(hidden=2048, heads=16, layers=4, intermediate=5632, vocab=32000, max_seq=8192)
TINY = Size(hidden=64, heads=4, layers=2, intermediate=176, vocab=256, max_seq=128)


class Skipped(Exception):
    """A variant that does not apply here (no Liger patch for the family, no liger_kernel)."""


# --------------------------------------------------------------------------- models


class LoRALinear(nn.Module):
    """base(x) + B(A(x)) * alpha / rank with base frozen; B starts at zero, so the adapted
    model starts as the base model. A keeps nn.Linear's (Kaiming uniform) initialisation."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        w = base.weight
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def add_lora(model: nn.Module) -> nn.Module:
    """Freezes every weight of a Llama and puts adapters on each layer's q_proj and v_proj."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = LoRALinear(attn.q_proj, LORA_RANK, LORA_ALPHA)
        attn.v_proj = LoRALinear(attn.v_proj, LORA_RANK, LORA_ALPHA)
    return model


def build_model(name: str, attn: str, size: Size, device, dtype) -> nn.Module:
    """The model `name` with attention `attn`, from seed 0, in training mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    d, heads, layers = size.hidden, size.heads, size.layers
    common = dict(vocab_size=size.vocab, attn_implementation=attn)
    if name == "gpt2":
        cls = transformers.GPT2LMHeadModel
        config = transformers.GPT2Config(
            n_embd=d,
            n_head=heads,
            n_layer=layers,
            n_positions=size.max_seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            **common,
        )
    elif name == "bert":
        cls = transformers.BertForMaskedLM
        config = transformers.BertConfig(
            hidden_size=d,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=4 * d,
            max_position_embeddings=size.max_seq,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
    else:
        cls = transformers.LlamaForCausalLM
        config = transformers.LlamaConfig(
            hidden_size=d,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=size.intermediate,
            max_position_embeddings=size.max_seq,
            use_cache=False,
            **common,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype)
        if name == "llama-lora":
            add_lora(model)
    return model.train()


def make_batch(name: str, seq: int, size: Size, device) -> dict:
    """input_ids and labels of batch 1, the same for every variant: the next tokens for the
    decoders (HF shifts them), the original tokens at the masked positions for BERT."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, size.vocab, (1, seq), generator=g)
    labels = ids
    if name == "bert":
        masked = torch.rand(1, seq, generator=g) < MLM_FRACTION
        masked[0, 0] = True  # at least one position to predict, at any length
        labels = torch.where(masked, ids, -100)
        ids = ids.masked_fill(masked, size.vocab - 1)  # the mask token
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


# --------------------------------------------------------------------------- variants


@contextlib.contextmanager
def _module_globals(module, values: dict):
    """Sets module-level names of `module` for the duration, restoring them after."""
    saved = {k: module.__dict__[k] for k in values}
    module.__dict__.update(values)
    try:
        yield
    finally:
        module.__dict__.update(saved)


def liger_patch(name: str) -> Callable:
    """Liger-Kernel's patch for the model family `name`; Skipped where it has none or
    liger_kernel does not import."""
    if not name.startswith("llama"):
        raise Skipped(f"Liger-Kernel has no patch for {name}")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as exc:
        raise Skipped(f"liger_kernel does not import: {exc}") from None
    return apply_liger_kernel_to_llama


def apply_liger(
    patch: Callable, model: nn.Module
) -> Callable[[], contextlib.AbstractContextManager]:
    """Patches a Llama instance with Liger's `patch`; returns the context its calls must run
    in. Liger also replaces names of transformers' modeling_llama module (the rotary
    embedding, which the attention looks up at every call, and the norm and MLP classes);
    those are put back at once and set again only around this model's calls, so that the
    other variants, alive at the same time, run unpatched."""
    from transformers.models.llama import modeling_llama

    before = dict(modeling_llama.__dict__)
    patch(model=model)
    changed = {
        k: v for k, v in modeling_llama.__dict__.items() if k not in before or before[k] is not v
    }
    if any(k not in before for k in changed):
        raise RuntimeError(f"Liger added names to modeling_llama: {sorted(changed)}")
    modeling_llama.__dict__.update({k: before[k] for k in changed})
    return functools.partial(_module_globals, modeling_llama, changed)


class Run:
    """One variant of one model: the module its steps call, the model whose parameters train,
    its optimizer, and the context its calls run in."""

    def __init__(self, variant: str, name: str, size: Size, device, dtype):
        liger = liger_patch(name) if variant == "liger" else None
        self.model = build_model(
            name, "eager" if variant == "eager" else "sdpa", size, device, dtype
        )
        self.context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.call: Callable = self.model
        if variant == "liger":
            self.context = apply_liger(liger, self.model)
        elif variant == "compile":
            self.call = torch.compile(self.model)
        elif variant == "convert+compile":
            self.call = torch.compile(mti.convert(self.model))
        elif variant in CONVERT_OPTIONS:
            self.call = mti.convert(self.model, **CONVERT_OPTIONS[variant])
        self.trainable = [(k, p) for k, p in self.model.named_parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            [p for _, p in self.trainable], fused=torch.device(device).type == "cuda"
        )

    def forward_backward(self, batch: dict) -> torch.Tensor:
        with self.context():
            loss = self.call(**batch).loss  # the output, logits included, is dropped here
            loss.backward()
        return loss.detach()

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, batch: dict) -> torch.Tensor:
        loss = self.forward_backward(batch)
        self.update()
        return loss

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {k: p.grad for k, p in self.trainable}


def converted_graph_calls(run: Run) -> int | None:
    """How many of convert's rewritten graphs the run's module has called so far (None: not
    a converted module; torch.compile's wrapper passes the attribute through)."""
    backend = getattr(run.call, "_backend", None)
    return None if backend is None else backend.graph_calls


def max_grad_diff(grads: dict, ref: dict) -> float:
    """The largest |grads - ref| over every parameter; a missing gradient counts as zeros."""
    if grads.keys() != ref.keys():
        raise RuntimeError("the variant's trainable parameters differ from the reference's")
    worst = []
    for k, r in ref.items():
        g = grads[k]
        if g is None and r is None:
            continue
        diff = r.float() if g is None else g.float() if r is None else g.float() - r.float()
        worst.append(diff.abs().max())
    return torch.stack(worst).max().item() if worst else 0.0


def failure_reason(exc: BaseException) -> str:
    """The exception's type and first lines, short enough for a record."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])}"[:400]


def _attempt(rec: dict, phase: str, fn: Callable):
    """(True, fn()), or (False, None) after recording in rec why fn raised (the traceback, and
    the tensors its frames hold, are dropped on return)."""
    try:
        return True, fn()
    except Skipped as exc:
        rec["skipped"] = str(exc)
    except Exception as exc:
        rec["error"] = f"{phase}: {failure_reason(exc)}"
    print(f"  {rec['variant']}: {rec['skipped'] or rec['error']}", flush=True)
    return False, None


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- measuring


def loss_phase(run: Run, batch: dict, n_steps: int, ref: dict | None, is_ref: bool) -> dict:
    """n_steps steps from fresh weights: the first step's gradients against the reference's
    (is_ref: this is the reference, whose gradients are returned as "ref"; ref None otherwise:
    the reference failed, no comparison), the losses of the 3rd and last steps."""
    losses = [run.forward_backward(batch)]
    grads = run.grads()
    out = {}
    if is_ref:
        ref = out["ref"] = {k: None if g is None else g.clone() for k, g in grads.items()}
    if ref is not None:
        present = [r.abs().max() for r in ref.values() if r is not None]
        out["max_grad_ref"] = torch.stack(present).max().item() if present else 0.0
        out["max_grad_diff"] = max_grad_diff(grads, ref)
    del grads
    run.update()
    losses += [run.step(batch) for _ in range(n_steps - 1)]
    out["loss"] = losses[2].item()
    out["loss_after_steps"] = losses[-1].item()
    return out


def run_case(name: str, seq: int, variants: list[str], args, size: Size, device, dtype, env):
    """Every variant of one model at one length: builds and trains each (loss_phase), then
    measures each one's peak, then times them all in turns."""
    torch._dynamo.reset()  # each case compiles afresh: no recompile limit carried over
    batch = make_batch(name, seq, size, device)
    n_steps = max(3, args.loss_steps)
    order = [REFERENCE] + [v for v in variants if v != REFERENCE]
    recs = {
        v: dict(
            env,
            bench="train",
            model=name,
            variant=v,
            seq=seq,
            batch=1,
            dtype=str(dtype).removeprefix("torch."),
            **dict.fromkeys(MEASURED),
            **{"pass": "train_step"},
        )
        for v in order
    }
    runs: dict[str, Run] = {}
    ref = None
    for v in order:
        rec = recs[v]
        ok, run = _attempt(rec, "build", functools.partial(Run, v, name, size, device, dtype))
        if ok:
            ok, out = _attempt(
                rec,
                "train",
                functools.partial(loss_phase, run, batch, n_steps, ref, v == REFERENCE),
            )
        if not ok:
            del run
            _free(device)
            continue
        ref = out.pop("ref", ref)
        rec.update(out, loss_steps=n_steps)
        runs[v] = run
        del run
    # Two rounds in turns first: a converted model's first call after another converted model
    # of the same class ran fails Dynamo's guards once and runs unconverted (then recaptures).
    for _ in range(2):
        for v, run in list(runs.items()):
            ok, _ = _attempt(recs[v], "warm-up", functools.partial(run.step, batch))
            if not ok:
                del runs[v], run
                _free(device)
    if device.type == "cuda":
        for v, run in list(runs.items()):
            step = functools.partial(run.step, batch)
            graphs = converted_graph_calls(run)
            ok, peak = _attempt(recs[v], "peak", functools.partial(peak_extra_bytes, step))
            recs[v]["peak_extra_bytes"] = peak
            if ok and graphs is not None and converted_graph_calls(run) == graphs:
                recs[v]["error"] = "peak: the measured step ran none of convert's graphs"
                recs[v]["peak_extra_bytes"] = None
            if ok:
                # The forward and backward alone: below peak_extra_bytes, the optimizer step
                # (the gradients and AdamW's temporaries) sets the step's peak.
                fwd_bwd = functools.partial(run.forward_backward, batch)
                ok, peak = _attempt(recs[v], "peak", functools.partial(peak_extra_bytes, fwd_bwd))
                recs[v]["fwd_bwd_peak_bytes"] = peak if recs[v]["peak_extra_bytes"] else None
                run.update()
            if not ok:
                del runs[v], run, step
                _free(device)
    time_runs(runs, batch, recs, args.steps, device)
    if args.profile:
        for v, run in runs.items():
            print(f"\n{name} T={seq} {v}: {profile_table(run, batch, args.profile)}", flush=True)
    for v in order:
        rec = recs[v]
        peak = "-" if rec["peak_extra_bytes"] is None else fmt_bytes(rec["peak_extra_bytes"])
        ms = "-" if rec["step_ms"] is None else f"{rec['step_ms']:.2f}"
        print(
            f"{name:10s} T={seq:<5d} {v:16s} {ms:>9s} ms  peak {peak:>10s}  "
            f"loss {rec['loss']}  max|dgrad| {rec['max_grad_diff']}",
            flush=True,
        )
    del runs, ref, batch
    _free(device)
    return [recs[v] for v in VARIANTS if v in recs]


def time_runs(runs: dict[str, Run], batch: dict, recs: dict, steps: int, device) -> None:
    """step_ms of every run, timed in turns; where that raises (an OOM with every variant
    alive), each run is timed alone and the one that raises is recorded."""
    names = list(runs)
    fns = [functools.partial(runs[v].step, batch) for v in names]
    timing = functools.partial(
        time_alternating, warmup_ms=0.0, rep_ms=0.0, min_turns=steps, device=device
    )
    try:
        by_fn = timing(fns)
    except Exception as exc:
        print(f"  timing all in turns: {failure_reason(exc)}; each alone", flush=True)
    else:
        for v, by_place in zip(names, by_fn):
            recs[v]["step_ms"] = place_median(by_place)
        return
    _free(device)
    for v, fn in zip(names, fns):
        ok, by_fn = _attempt(recs[v], "time", lambda fn=fn: timing([fn]))
        if ok:
            recs[v]["step_ms"] = place_median(by_fn[0])
        _free(device)


def profile_table(run: Run, batch: dict, rows: int) -> str:
    """torch.profiler's table of two steps of `run`, the `rows` ops and kernels that took the
    most time on the device (the CPU's where there is no GPU), headed by the steps' wall time
    and the device's busy time, which tell a step bound by its launches from one bound by its
    kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = next(run.model.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(2):
            run.step(batch)
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / 2
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # On the GPU, the kernels' own events: an op's self device time, or a range's, counts its
    # kernels again (the table's own total takes the same ones).
    busy = [
        e
        for e in events
        if not cuda or (e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    ]
    busy_ms = sum(getattr(e, key) for e in busy) / 1e3 / 2
    table = events.table(sort_by=key, row_limit=rows)
    return f"step {wall_ms:.2f} ms, {busy_ms:.2f} ms of it busy on the device\n{table}"


# --------------------------------------------------------------------------- report


def _by_case(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    cases: dict[tuple, dict[str, dict]] = {}
    for r in records:
        cases.setdefault((r["model"], r["seq"]), {})[r["variant"]] = r
    return cases


def table_rows(records: list[dict]) -> list[dict]:
    """Each record with its step time and peak as ratios to the sdpa model's, and its loss
    after loss_steps less sdpa's."""
    cases = _by_case(records)
    return [
        ratio_row(r, cases[(r["model"], r["seq"])].get(REFERENCE, {}), "loss_after_steps")
        for r in records
    ]


def ratio_row(r: dict, base: dict, loss: str) -> dict:
    """A table row of record r: its peaks formatted, its step time and peak as ratios to
    base's (the reference's record, {} when it has none), its `loss` field less base's as
    loss_diff, and its error or skip as a note fit for a table cell."""
    row = dict(r)
    for key, out in (("peak_extra_bytes", "peak"), ("fwd_bwd_peak_bytes", "fwd_bwd_peak")):
        row[out] = None if r.get(key) is None else fmt_bytes(r[key])
    for key, out in (("step_ms", "ms_ratio"), ("peak_extra_bytes", "peak_ratio")):
        if r[key] is not None and base.get(key):
            row[out] = r[key] / base[key]
    if r[loss] is not None and base.get(loss) is not None:
        row["loss_diff"] = r[loss] - base[loss]
    note = r["error"] or r["skipped"]
    row["note"] = None if note is None else note.replace("|", "/")[:80]
    return row


def goals(records: list[dict]) -> list[str]:
    """The issue's goals, one line per model, length >= GOAL_MIN_SEQ and variant of ours:
    peak and step time against the best peer's; and the loss after loss_steps against sdpa's,
    next to the peers' own distance from sdpa's (what bf16 rounding alone moves it by)."""
    lines = []
    for (model, seq), case in _by_case(records).items():
        peers = [r for v, r in case.items() if v not in OURS]
        for v in OURS:
            r = case.get(v)
            if r is None:
                continue
            if r["error"]:
                lines.append(f"FAIL {model} T={seq} {v}: {r['error'][:120]}")
                continue
            ref_loss = case[REFERENCE]["loss_after_steps"]
            if ref_loss is None:
                continue
            noise = [
                abs(p["loss_after_steps"] - ref_loss)
                for p in peers
                if p["variant"] != REFERENCE and p["loss_after_steps"] is not None
            ]
            diff = abs(r["loss_after_steps"] - ref_loss)
            verdict = "    " if not noise else "PASS" if diff <= max(noise) else "FAIL"
            lines.append(
                f"{verdict} {model} T={seq} {v}: loss after {r['loss_steps']} steps differs "
                f"from sdpa's by {diff:.3g} (peers: up to {max(noise, default=float('nan')):.3g})"
            )
            line = seq >= GOAL_MIN_SEQ and goal_line(f"{model} T={seq} {v}", r, peers, "peak")
            if line:
                lines.append(line)
    return lines


def goal_line(label: str, r: dict, peers: list[dict], what: str) -> str | None:
    """PASS or FAIL of the issue's goal for record r: its peak (`what`) <= PEAK_GOAL x the
    lowest of the peers' and its step time <= STEP_GOAL x the fastest's; None where a figure
    is missing."""
    peaks = [p["peak_extra_bytes"] for p in peers if p["peak_extra_bytes"] is not None]
    times = [p["step_ms"] for p in peers if p["step_ms"] is not None]
    if r["peak_extra_bytes"] is None or not peaks or not times:
        return None
    peak_ratio = r["peak_extra_bytes"] / min(peaks)
    ms_ratio = r["step_ms"] / min(times) if r["step_ms"] is not None else float("inf")
    ok = peak_ratio <= PEAK_GOAL and ms_ratio <= STEP_GOAL
    return (
        f"{'PASS' if ok else 'FAIL'} {label}: {what} {peak_ratio:.3f}x the lowest peer's "
        f"(goal <= {PEAK_GOAL}), step {ms_ratio:.3f}x the fastest peer's (goal <= {STEP_GOAL})"
    )


def report(records: list[dict]) -> None:
    columns = [
        "model",
        "seq",
        "variant",
        "step_ms",
        "ms_ratio",
        "peak",
        "peak_ratio",
        "fwd_bwd_peak",
        "loss",
        "loss_after_steps",
        "loss_diff",
        "max_grad_diff",
        "note",
    ]
    goal_lines = goals(records)
    md = (
        "Ratios are to the sdpa model's; loss is the 3rd step's, loss_after_steps the "
        "loss_steps-th's (in train.json), loss_diff that less sdpa's; max_grad_diff: the first "
        "step's gradients against sdpa's; fwd_bwd_peak: the forward and backward's peak "
        "alone (where it is below peak, the optimizer step sets the peak).\n\n"
        + markdown_table(table_rows(records), columns)
    )
    if goal_lines:
        md += "\nGoals:\n\n" + "".join(f"- {g}\n" for g in goal_lines)
    print("\n" + md)
    json_path, md_path = write_results("train", records, md)
    print(f"wrote {json_path}, {md_path}")
    plot_peaks(records)


def plot_peaks(records: list[dict]) -> None:
    """train_peak.png: peak MiB against sequence length, a panel per model, a line per variant."""
    panels = []
    for model in dict.fromkeys(r["model"] for r in records):
        series = {
            v: [
                (r["seq"], r["peak_extra_bytes"] / 2**20)
                for r in records
                if r["model"] == model and r["variant"] == v and r["peak_extra_bytes"] is not None
            ]
            for v in VARIANTS
        }
        series = {v: points for v, points in series.items() if points}
        if series:
            panels.append((f"{model} (batch 1, training step)", series))
    if not panels:
        return
    path = results_dir() / "train_peak.png"
    try:
        plot_grid(path, panels, "sequence length", "peak MiB", ncols=len(panels))
    except ImportError as exc:
        print(f"no plot: {exc}")
        return
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--seq", nargs="+", type=int, default=None, help="default 2048 4096 8192")
    parser.add_argument(
        "--steps", type=int, default=12, help="timed steps per variant, at least (whole turns)"
    )
    parser.add_argument("--loss-steps", type=int, default=20, help="steps of the loss-parity run")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="2 layers, hidden 64, vocab 256, seq 64: a code-path check (forced without a GPU)",
    )
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument(
        "--quick", action="store_true", help="Llama at seq 4096, 6 timed and 3 loss steps"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="after timing, print torch.profiler's ROWS costliest ops and kernels of each variant",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep train.json's records of other (model, seq) cases when they are of this "
        "commit, device and torch (a sweep run in parts)",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device) if args.device else best_device()
    if device.type == "cpu" and not args.tiny:
        print("no GPU: tiny configs (--tiny)")
        args.tiny = True
    size = TINY if args.tiny else FULL
    if args.quick:
        args.models, args.steps, args.loss_steps = ["llama"], 6, 3
    seqs = args.seq or (TINY_SEQS if args.tiny else [4096] if args.quick else SEQS)
    if max(seqs) > size.max_seq:
        parser.error(f"seq {max(seqs)} exceeds the configs' positions, {size.max_seq}")
    # fp32 on the CPU: the tiny check compares variants tightly there.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = env_info()
    print(f"{env['device']}, torch {env['torch']}, commit {env['commit']}")
    cases = {(m, s) for m in args.models for s in seqs}
    records = []
    if args.append:
        records = earlier_records("train", env, lambda r: (r["model"], r["seq"]) not in cases)
    for name in args.models:
        for seq in seqs:
            records += run_case(name, seq, args.variants, args, size, device, dtype, env)
            report(records)  # after each case: a sweep cut short keeps what it measured


if __name__ == "__main__":
    main()
