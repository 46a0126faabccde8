"""The notes and the printed table of scripts/bench.py (its targets: ``_bench_targets``)."""

from __future__ import annotations

from typing import Any

from _bench_targets import MIB

__all__ = ["MEMORY_NOTE", "BYTES_NOTE", "table"]

MEMORY_NOTE = (
    "Overhead = peak RssAnon during resume minus RssAnon right after it (model + optimizer state, the "
    "steady footprint), per rank, as a % of the checkpoint file. RssAnon is polled by the parent every 2 ms "
    "from /proc/<pid>/status (there is no peak field; VmHWM would count the mapped file's page cache). "
    "Pages of a memory-mapped checkpoint are file-backed: they show in RssFile, reported as file_pages_mapped. "
    "'warm' = the optimizer already held state when resume was called. The model is not DDP-wrapped: DDP's "
    "gradient buckets would add the same amount to every column."
)
BYTES_NOTE = (
    "rchar from /proc/self/io around resume(), with mmap=False so that the file is read with read(): rchar "
    "does not count page faults on a memory-mapped file. gloo receives with recv(), which rchar does not "
    "count either (checked: a 64 MiB broadcast adds ~100 bytes on the receiver), so rchar is the file's bytes "
    "plus a few hundred bytes of other reads. Under broadcast_from_rank0 rank 1 is handed a path that does not "
    "exist, so it cannot have opened the file. For the default mmap=True the memory runs report the file "
    "pages each rank mapped (peak RssFile growth): the same picture."
)


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def _mem_cell(entry: dict[str, Any]) -> str:
    worst = max(entry["ranks"], key=lambda r: r["overhead"])
    return f"{_mib(worst['overhead'])} ({worst['overhead_pct']:.1f}%)"


def table(doc: dict[str, Any]) -> str:
    ck, mem, wall, stall = doc["checkpoint"], doc["memory"], doc["wall"], doc["save_stall"]
    rd, pre, v = doc["bytes_read"], doc["prefix"], doc["targets"]
    fb = ck["file_bytes"]
    split = ck["split"]
    yes = {True: "met", False: "MISSED"}
    lines = [
        f"dist_resume benchmark: checkpoint {fb / 2**30:.2f} GiB = params {_mib(split['params'])} + "
        f"exp_avg {_mib(split['exp_avg'])} + exp_avg_sq {_mib(split['exp_avg_sq'])} + {ck['tensors'] // 4} "
        f"step scalars and the pickle ({ck['params']:,} fp32 parameters in {ck['tensors']:,} tensors, largest "
        f"{_mib(ck['largest_tensor_bytes'])}); {doc['machine']['cpus']} CPUs, torch {doc['machine']['torch']}, "
        "1 thread per process",
        "",
        f"{'#':<3}{'measure':<58}{'dist_resume':>22}{'comparison':>26}{'figure':>14}  target",
    ]

    def row(num: str, what: str, ours: str, other: str, figure: str, target: str = "") -> None:
        lines.append(f"{num:<3}{what:<58}{ours:>22}{other:>26}{figure:>14}  {target}")

    for key, label, naive, verdict in (
        ("dist_resume", "peak RssAnon over steady, 2 ranks, fresh Adam", "naive", "1_memory_overhead_fresh"),
        ("dist_resume_warm", "  ... optimizer already holding state", "naive_warm", "1_memory_overhead_warm"),
        (
            "dist_resume_broadcast",
            "  ... broadcast_from_rank0 (worst rank) vs naive",
            "naive",
            "1_memory_overhead_broadcast",
        ),
    ):
        ours, theirs = mem[key], mem[naive]
        row(
            "1" if key == "dist_resume" else "",
            label,
            _mem_cell(ours),
            "naive " + _mem_cell(theirs),
            f"{ours['overhead_pct_max']:.1f}% vs {theirs['overhead_pct_max']:.0f}%",
            f"<= 10%: {yes[v[verdict]['met']]}",
        )
    b = mem["dist_resume_broadcast"]["ranks"]
    row(
        "",
        "  ... broadcast_from_rank0: rank 0 / rank 1",
        f"{b[0]['overhead_pct']:.1f}% / {b[1]['overhead_pct']:.1f}%",
        "",
        "",
        "",
    )
    med, best = wall["median"], wall["best"]
    for key, label, verdict in (
        ("resume_fresh", "resume wall time / readinto, fresh Adam (median)", "2_wall_fresh_vs_readinto"),
        ("resume_warm", "  ... optimizer already holding state", "2_wall_warm_vs_readinto"),
    ):
        row(
            "2" if key == "resume_fresh" else "",
            label,
            f"{med[key]:.2f} s",
            f"readinto {med['readinto']:.2f} s",
            f"{med[key] / med['readinto']:.2f}x",
            f"<= 1.5x: {yes[v[verdict]['met']]}",
        )
    row(
        "",
        "  ... best of rounds",
        f"{best['resume_fresh']:.2f} s",
        f"readinto {best['readinto']:.2f} s",
        f"{best['resume_fresh'] / best['readinto']:.2f}x",
        "",
    )
    cm = wall["cpu_median"]
    row(
        "",
        "  ... thread CPU time (other load disturbs it less)",
        f"{cm['resume_fresh']:.2f} s",
        f"readinto {cm['readinto']:.2f} s",
        f"{cm['resume_fresh'] / cm['readinto']:.2f}x",
        "",
    )
    row(
        "",
        "  ... thread CPU time, optimizer holding state",
        f"{cm['resume_warm']:.2f} s",
        f"readinto {cm['readinto']:.2f} s",
        f"{cm['resume_warm'] / cm['readinto']:.2f}x",
        "",
    )
    split = doc["checkpoint"]["split"]
    opt_bytes = fb - split["params"]
    for key, label, nbytes in (
        ("copy_into_params", "copy file -> existing parameters", split["params"]),
        ("clone_state", "copy file -> new Adam-state tensors (clone)", opt_bytes),
    ):
        row(
            "",
            f"  ... of which {label}",
            f"{med[key]:.2f} s",
            f"readinto {med['readinto'] * nbytes / fb:.2f} s",
            f"{med[key] / (med['readinto'] * nbytes / fb):.2f}x",
            f"({_mib(nbytes)})",
        )
    moves = med["copy_into_params"] + med["clone_state"]
    row(
        "",
        "  ... resume / its two moves alone (sum of the above)",
        f"{med['resume_fresh']:.2f} s",
        f"two moves {moves:.2f} s",
        f"{med['resume_fresh'] / moves:.2f}x",
        "",
    )
    row(
        "",
        "  ... new memory alone: allocate + write Adam-state bytes",
        f"{med['first_touch_state']:.2f} s",
        f"readinto {med['readinto'] * opt_bytes / fb:.2f} s",
        f"{med['first_touch_state'] / (med['readinto'] * opt_bytes / fb):.2f}x",
        f"({_mib(opt_bytes)})",
    )
    row(
        "",
        "  ... vs readinto into a newly allocated buffer",
        f"{med['resume_fresh']:.2f} s",
        f"fresh buffer {med['readinto_fresh']:.2f} s",
        f"{med['resume_fresh'] / med['readinto_fresh']:.2f}x",
        "",
    )
    row(
        "",
        "  ... naive torch.load + load_state_dict",
        f"{med['resume_fresh']:.2f} s",
        f"naive {med['naive_fresh']:.2f} s",
        f"{med['resume_fresh'] / med['naive_fresh']:.2f}x",
        "",
    )
    each, bc = rd["read_each"], rd["read_broadcast"]
    row(
        "3",
        "file bytes read by 2 ranks (rchar, mmap=False)",
        f"bcast {bc['total_vs_file']:.3f}x file",
        f"each reads {each['total_vs_file']:.3f}x",
        f"1x vs {each['total_vs_file']:.2f}x",
        f"1x vs kx: {yes[v['3_bytes_read']['met']]}",
    )
    row(
        "",
        "  ... per rank, broadcast_from_rank0",
        f"{_mib(bc['rchar'][0])} / {bc['rchar'][1]:,} B",
        f"{_mib(each['rchar'][0])} / {_mib(each['rchar'][1])}",
        "",
        "",
    )
    mb, me = mem["dist_resume_broadcast"]["ranks"], mem["dist_resume"]["ranks"]
    row(
        "",
        "  ... mmap=True: file pages mapped, rank 0 / rank 1",
        f"{_mib(mb[0]['file_pages_mapped'])} / {_mib(mb[1]['file_pages_mapped'])}",
        f"{_mib(me[0]['file_pages_mapped'])} / {_mib(me[1]['file_pages_mapped'])}",
        "",
        "",
    )
    sa, ss = stall["median"]["async"], stall["median"]["sync"]
    row(
        "4",
        "training-loop stall, async vs sync save (median)",
        f"{sa['stall']:.2f} s",
        f"sync {ss['stall']:.2f} s",
        f"{100 * stall['ratio']:.0f}%",
        f"<= 25%: {yes[v['4_async_stall_vs_sync']['met']]}",
    )
    row(
        "",
        "  ... the save_checkpoint_async call (snapshot)",
        f"{sa['call']:.2f} s",
        f"sync {ss['call']:.2f} s",
        f"{100 * stall['call_ratio']:.0f}%",
        "",
    )
    row(
        "",
        f"  ... slower steps while writing ({sa['steps_during']:.0f} steps)",
        f"{sa['interference']:.2f} s",
        f"write took {sa['write']:.2f} s",
        "",
        "",
    )
    for key, floor, label in (
        ("adapt_state_dict", "dict_add_prefix", "adapt_state_dict"),
        ("strip_prefix", "dict_strip_prefix", "strip_prefix"),
    ):
        e, f = pre[key], pre[floor]
        c = e["copies"]
        row(
            "5" if key == "adapt_state_dict" else "",
            f"{label}, {pre['keys']:,} keys ({_mib(pre['tensor_bytes'])})",
            f"{e['median'] * 1e3:,.0f} ms",
            f"dict comprehension {f['median'] * 1e3:,.0f} ms",
            f"{e['median'] / f['median']:.1f}x",
            "",
        )
        row(
            "",
            "  ... tensors not the input's (object / data_ptr); RssAnon peak",
            f"{c['other_object']} / {c['other_data_ptr']}; {_mib(e['peak_anon_over_before_kib'] * 1024)} ",
            f"of {c['entries']:,}; tensors {_mib(pre['tensor_bytes'])}",
            "",
            f"0 copies: {yes[v['5_prefix_zero_copies']['met']]}" if key == "strip_prefix" else "",
        )
    row(
        "",
        "  ... torch consume_prefix_in_state_dict_if_present",
        "",
        f"{pre['torch_consume_prefix']['median'] * 1e3:,.0f} ms",
        "",
        "",
    )
    probes = {r["probe"] for e in mem.values() for r in e["ranks"]} | {p for e in rd.values() for p in e["probe"]}
    load = doc["machine"]["loadavg"]
    lines += [
        "",
        f"restored values identical in every run and rank: {len(probes) == 1}; whole run "
        f"{doc['seconds']:.0f} s; 1-min load average {load['start']:.1f} at the start, {load['end']:.1f} "
        f"at the end (on {doc['machine']['cpus']} CPUs)",
        f"reproduce: {doc['command']}",
    ]
    return "\n".join(lines)
