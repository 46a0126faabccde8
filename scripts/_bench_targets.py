"""The targets of scripts/bench.py: each measure of its run against its target (met or not)."""

from __future__ import annotations

from typing import Any

__all__ = ["MIB", "verdicts"]

MIB = 2**20


def _pct_ok(value: float, limit: float) -> bool:
    return value <= limit


def verdicts(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    mem, wall, stall, rd, pre = doc["memory"], doc["wall"], doc["save_stall"], doc["bytes_read"], doc["prefix"]
    file_bytes = doc["checkpoint"]["file_bytes"]
    med = wall["median"]
    each, bcast = rd["read_each"], rd["read_broadcast"]
    copies = sum(
        pre[k]["copies"]["other_object"] + pre[k]["copies"]["other_data_ptr"]
        for k in ("adapt_state_dict", "strip_prefix")
    )
    return {
        "1_memory_overhead_fresh": {
            "value_pct": mem["dist_resume"]["overhead_pct_max"],
            "target": "<= 10%",
            "met": _pct_ok(mem["dist_resume"]["overhead_pct_max"], 10),
        },
        "1_memory_overhead_warm": {
            "value_pct": mem["dist_resume_warm"]["overhead_pct_max"],
            "target": "<= 10%",
            "met": _pct_ok(mem["dist_resume_warm"]["overhead_pct_max"], 10),
        },
        "1_memory_overhead_broadcast": {
            "value_pct": mem["dist_resume_broadcast"]["overhead_pct_max"],
            "target": "<= 10%",
            "met": _pct_ok(mem["dist_resume_broadcast"]["overhead_pct_max"], 10),
        },
        "2_wall_fresh_vs_readinto": {
            "value": med["resume_fresh"] / med["readinto"],
            "target": "<= 1.5x",
            "met": med["resume_fresh"] / med["readinto"] <= 1.5,
        },
        "2_wall_warm_vs_readinto": {
            "value": med["resume_warm"] / med["readinto"],
            "target": "<= 1.5x",
            "met": med["resume_warm"] / med["readinto"] <= 1.5,
        },
        "3_bytes_read": {
            "each": each["total_vs_file"],
            "broadcast": bcast["total_vs_file"],
            "target": "1x with broadcast_from_rank0, k x without",
            "met": bcast["total_vs_file"] <= 1.01
            and each["total_vs_file"] >= 1.99
            and bcast["rchar"][1] < MIB
            and not bcast["opened"][1],
        },
        "4_async_stall_vs_sync": {"value_pct": 100 * stall["ratio"], "target": "<= 25%", "met": stall["ratio"] <= 0.25},
        "5_prefix_zero_copies": {
            "copies": copies,
            "target": "0 copies",
            "met": copies == 0
            and all(
                pre[k]["anon_delta_kib"] * 1024 < 0.5 * pre["tensor_bytes"]
                for k in ("adapt_state_dict", "strip_prefix")
            ),
        },
        "file_bytes": {"value": file_bytes},
    }
