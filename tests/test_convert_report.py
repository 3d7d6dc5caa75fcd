"""convert() never makes a graph's memory worse, and reports what it did honestly: one line
per rewritten site, and a total that is the drop of the graph's tensor peak (which the sites'
bytes bound, and which a measured peak confirms on CPU)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import check_converted
from torch import nn

import make_torch_inplace as mti
from benchmarks.common import peak_extra_bytes

rewrite_module = importlib.import_module("make_torch_inplace.convert.rewrite")


def _tiny_gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=128, attn_implementation="eager"
    )
    torch.manual_seed(0)
    return _IdsToHidden(transformers.GPT2Model(config).eval())


class _IdsToHidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def _converted_gpt2(capsys):
    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    converted = mti.convert(model, verbose=True)
    with torch.inference_mode():
        converted(ids)
    return model, converted, ids, capsys.readouterr().out.splitlines()


def test_verbose_report_of_a_tiny_gpt2_has_one_line_per_site(capsys):
    _, converted, _, lines = _converted_gpt2(capsys)
    [graph] = converted._backend.reports
    assert lines == graph.lines() and converted.report() == "\n".join(lines)
    head, *site_lines = lines
    assert f"{len(graph.sites)} sites" in head
    assert site_lines == [f"  {site}" for site in graph.sites]
    assert len(set(site_lines)) == len(site_lines), "a site listed twice"
    # Each attention is one site (attention_in_pieces took its softmax_), the written-out GELU
    # one (fused into F.gelu, then run in place).
    attention = [s for s in graph.sites if "softmax" in s.pattern]
    assert [s.op for s in attention] == ["attention_in_pieces"] * 2
    assert all(s.pattern.startswith("matmul -> mul -> add -> softmax") for s in attention)
    assert not [s for s in graph.sites if s.op == "softmax_"]
    assert len([s for s in graph.sites if s.op == "gelu_"]) == 2


def test_report_total_is_bounded_and_measured(capsys):
    """The total (the drop of the graph's tensor peak) is at most the sum of the sites' bytes
    (the argument in GraphReport) and at most the drop of the peak measured on CPU."""
    model, converted, ids, _ = _converted_gpt2(capsys)
    [graph] = converted._backend.reports
    saved = graph.before - graph.after
    assert 0 < saved <= sum(s.nbytes for s in graph.sites)
    with torch.inference_mode():
        measured_before = peak_extra_bytes(lambda: model(ids), device="cpu")
        measured_after = peak_extra_bytes(lambda: converted(ids), device="cpu")
    assert graph.after <= measured_after, "the graph's tensors are part of what is measured"
    assert saved <= measured_before - measured_after


class _BiasedAttention(nn.Module):
    """Attention with a learned position bias (T5's) and a constant mask applied to it, as
    transformers does under torch.compile: torch.where(all_true, bias, lowest), or the bias
    plus an all-zero additive mask. Eager mode would pass the bias itself."""

    def __init__(self, additive: bool, layers: int = 3, heads: int = 2, d: int = 16):
        super().__init__()
        self.additive, self.heads = additive, heads
        self.bias = nn.Parameter(torch.randn(heads, 32))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))

    def forward(self, x):
        b, t, d = x.shape
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        bias = self.bias[:, (rel + 16).clamp(0, 31)].unsqueeze(0)  # (1, heads, t, t)
        if self.additive:
            mask = torch.zeros(1, 1, t, t, dtype=x.dtype)
        else:  # one per batch element: where() broadcasts the bias over the batch
            mask = (torch.arange(t)[None, :] >= 0).expand(b, 1, t, t)
        for qkv in self.qkv:
            q, k, v = qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            if self.additive:
                masked = bias + mask
            else:
                masked = torch.where(mask, bias, torch.finfo(x.dtype).min)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=masked)
            x = x + o.transpose(1, 2).reshape(b, t, d)
        return x


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("additive", [False, True])
def test_a_mask_keeping_every_element_is_not_applied(additive, batch):
    model = _BiasedAttention(additive).eval()
    x = torch.randn(batch, 24, 16, generator=torch.Generator().manual_seed(1))
    converted = check_converted(model, x)
    [graph] = converted._backend.reports
    dropped = [s for s in graph.sites if "mask keeping every element" in s.pattern]
    assert len(dropped) == 3, "one copy of the bias per layer"
    assert graph.after < graph.before
    with torch.no_grad():
        assert peak_extra_bytes(lambda: converted(x), device="cpu") <= peak_extra_bytes(
            lambda: model(x), device="cpu"
        )


class _WrittenAfterMasking(nn.Module):
    """The masked copy is written in place (or returned): it must stay a copy."""

    def __init__(self, returned: bool):
        super().__init__()
        self.returned = returned
        self.p = nn.Parameter(torch.randn(1, 2, 8, 8))

    def forward(self, x):
        keep = (torch.arange(8)[None, :] >= 0).expand(8, 8)
        bias = self.p * 2
        masked = torch.where(keep, bias, -1e9)
        if self.returned:
            return masked, bias + x
        masked.add_(1.0)
        return masked + bias + x


@pytest.mark.parametrize("returned", [False, True])
def test_a_masked_copy_that_is_written_or_returned_stays(returned):
    model = _WrittenAfterMasking(returned).eval()
    converted = check_converted(model, torch.randn(1, 2, 8, 8))
    assert not [s for s in converted.sites if "mask keeping every element" in s.pattern]


def test_a_graph_whose_rewrites_would_raise_its_peak_runs_as_captured(monkeypatch, capsys):
    """The last check of _rewrite_graph: a graph whose tensor peak the rewrites would raise
    is left as captured (forced here by reporting a higher peak after the rewrites)."""
    peaks = iter([100, 200])
    monkeypatch.setattr(rewrite_module, "tensor_peak", lambda graph: next(peaks))
    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    converted = mti.convert(model, verbose=True)
    with torch.inference_mode():
        out = converted(ids)
        expected = model(ids)
    assert torch.equal(out, expected), "the captured graph computes what the model does"
    assert converted.sites == []
    assert "graph left as captured" in capsys.readouterr().out
