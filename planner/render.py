"""rich tables and JSON output. No arithmetic here beyond formatting."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.table import Table

from planner.specs import HardwareSpec, ModelSpec


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def models_table(specs: list[ModelSpec]) -> Table:
    t = Table(title="Model presets")
    for col in ("name", "params", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", "act", "norm"):
        t.add_column(col, justify="left" if col in ("name", "act", "norm") else "right")
    for s in specs:
        t.add_row(s.name, _billions(s.num_params), str(s.num_layers), str(s.hidden_size),
                  str(s.num_attention_heads), str(s.kv_heads), str(s.ffn_size), str(s.vocab_size),
                  s.activation, s.norm)
    return t


def hardware_table(specs: list[HardwareSpec]) -> Table:
    t = Table(title="Hardware profiles")
    for col in ("name", "memory GiB", "usable GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "GPUs/node",
                "intra GB/s", "inter GB/s"):
        t.add_column(col, justify="left" if col == "name" else "right")
    for s in specs:
        t.add_row(s.name, f"{s.gpu_memory_gib:g}", f"{s.usable_memory_gib:.1f}", f"{s.peak_bf16_tflops:g}",
                  f"{s.peak_fp8_tflops:g}" if s.peak_fp8_tflops else "-", str(s.gpus_per_node),
                  f"{s.intra_node_bandwidth_gbps:g}", f"{s.inter_node_bandwidth_gbps:g}")
    return t


def spec_dict(spec: ModelSpec | HardwareSpec) -> dict:
    data = spec.model_dump()
    if isinstance(spec, ModelSpec):
        data |= {"num_params": spec.num_params, "layer_params": spec.layer_params(),
                 "kv_heads": spec.kv_heads, "ffn_size": spec.ffn_size, "head_dim": spec.kv_channels}
    else:
        data |= {"usable_memory_gib": spec.usable_memory_gib}
    return data


def spec_table(spec: ModelSpec | HardwareSpec) -> Table:
    kind = "Model" if isinstance(spec, ModelSpec) else "Hardware"
    t = Table(title=f"{kind}: {spec.name}")
    t.add_column("field")
    t.add_column("value", justify="right")
    data = spec_dict(spec)
    derived = set(data) - set(spec.model_dump())
    for key, value in data.items():
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
        t.add_row(f"[bold]{key}[/bold] (derived)" if key in derived else key, shown)
    return t
