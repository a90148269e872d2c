"""Collects the parts of ``benchmarks/gpu_check.sh`` into one JSON summary and prints it (standard library only,
so that it still runs when torch does not import).

Each part left, in the logs folder, a line ``name<TAB>exit status<TAB>seconds<TAB>limit`` in ``parts.tsv``, its log
``name.log`` and, for most parts, its figures: ``name.json`` (the race checks), ``cuda_tests.xml`` (pytest's
JUnit report) or ``streaming_cuda.json`` (the benchmark).

Usage:
    python benchmarks/gpu_check_summary.py --logs benchmarks/results/gpu/logs --out benchmarks/results/gpu/summary.json
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Optional

PARTS = {
    "race": "delay injection: bitwise equal with delays on each side",
    "launch_blocking": "CUDA_LAUNCH_BLOCKING=1: bitwise equal",
    "sanitizer": "TORCH_CUDA_SANITIZER=1: no race reported",
    "profiler": "profiler: engine copies pinned, on side streams; overlap and GB/s",
    "cuda_tests": "pytest tests/test_strategy_cuda.py tests/test_moe_cuda.py",
    "benchmark": "bench_streaming.py, one point: step time and peak memory against plain",
}
TIMED_OUT = {124, 137}  # timeout(1): the limit was hit (137: it had to be killed)
SKIPPED = 3  # the status gpu_check.sh records for a part it did not run on this device


def _tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return [line[:240] for line in path.read_text(errors="replace").splitlines()[-lines:]]
    except OSError:
        return []


def _load_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit(path: Path) -> Optional[dict[str, Any]]:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = ("tests", "failures", "errors", "skipped")
    figures: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in suites) for k in counts}
    figures["time_s"] = round(sum(float(s.get("time", 0.0)) for s in suites), 1)
    failed, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append({"test": name, "message": (problem.get("message") or "")[:400]})
        elif case.find("skipped") is not None:
            skipped.append(name)
    figures.update(failed=failed, skipped_tests=skipped, passed=not failed and figures["tests"] > len(skipped))
    if figures["tests"] and figures["tests"] == len(skipped):
        figures["note"] = "every test was skipped: torch saw no GPU"
    return figures


def _benchmark(path: Path) -> Optional[dict[str, Any]]:
    data = _load_json(path)
    if data is None:
        return None
    rows = data.get("rows", [])
    plain = next((r for r in rows if r.get("strategy") == "plain"), None)
    figures: dict[str, Any] = {
        "points": [
            {
                "strategy": r.get("strategy"), "tokens": r.get("tokens"), "step_s": r.get("step_s"),
                "peak_device_mib": round(r["device_bytes"] / 2**20, 1) if "device_bytes" in r else None,
                "step_time_vs_plain": r.get("time_ratio"), "peak_memory_vs_plain": r.get("memory_ratio"),
            }
            for r in rows
        ],
        "h2d_gbps_one_bf16_block": data.get("h2d_gbps_one_bf16_block"),
        "host_adamw_step_ms": data.get("host_adamw_step_ms"),
        "device_name": data.get("device_name"),
    }
    figures["passed"] = plain is not None and len(rows) > 1
    return figures


def _figures(name: str, logs: Path) -> Optional[dict[str, Any]]:
    if name == "cuda_tests":
        return _junit(logs / "cuda_tests.xml")
    if name == "benchmark":
        return _benchmark(logs / "streaming_cuda.json")
    return _load_json(logs / f"{name}.json")


def summarize(logs: Path) -> dict[str, Any]:
    ran: dict[str, tuple[int, int, int]] = {}
    table = logs / "parts.tsv"
    if table.exists():
        for line in table.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) == 4:
                ran[fields[0]] = (int(fields[1]), int(fields[2]), int(fields[3]))
    parts: dict[str, Any] = {}
    for name, what in PARTS.items():
        entry: dict[str, Any] = {"what": what}
        if name not in ran:
            entry["status"] = "not_run"
            parts[name] = entry
            continue
        rc, seconds, limit = ran[name]
        figures = _figures(name, logs)
        if rc == SKIPPED:
            status = "skipped"
        elif rc in TIMED_OUT:
            status = "timed_out"
        elif rc == 0 and figures is not None and figures.get("passed") is None and figures.get("skipped"):
            status = "skipped"
        elif rc == 0 and (figures is None or figures.get("passed") is not False):
            status = "passed"
        else:
            status = "failed"
        entry.update(status=status, exit_status=rc, seconds=seconds, limit_s=limit)
        if figures is not None:
            entry["figures"] = figures
        if status in ("failed", "timed_out"):
            entry["log_tail"] = _tail(logs / f"{name}.log")
        parts[name] = entry
    machine = logs / "machine.txt"
    statuses = [p["status"] for p in parts.values()]
    return {
        "passed": all(s in ("passed", "skipped") for s in statuses) and "passed" in statuses,
        "statuses": {name: p["status"] for name, p in parts.items()},
        "total_s": sum(p.get("seconds", 0) for p in parts.values()),
        "machine": machine.read_text().strip().splitlines() if machine.exists() else [],
        "parts": parts,
    }


def _headline(name: str, part: dict[str, Any]) -> str:
    """One line of the most telling figures of a part."""
    figures = part.get("figures") or {}
    try:
        if name == "race":
            cases = figures.get("cases", {})
            bits = [f"control={'equal' if figures.get('control', {}).get('equal') else 'DIFFERENT'}"]
            bits += [f"{k.split('_')[0]}=n/a" if "not_applicable" in c and "equal" not in c else
                     f"{k.split('_')[0]}={'equal' if c.get('equal') else 'DIFFERENT'}"
                     f"[{'ok' if c.get('as_expected') else 'BAD'}](max|dw|={c.get('max_abs_weight_difference')},"
                     f" n={c.get('injected')})" for k, c in cases.items()]
            calibration = figures.get("calibration", {})
            if "block_forward_ms" in calibration:
                bits.append(
                    f"block fwd {calibration['block_forward_ms']:.2f} ms vs upload"
                    f" {calibration['block_upload_ms']:.2f} ms, sleep {calibration['sleep_ms']:.1f} ms"
                )
            return ", ".join(bits)
        if name == "launch_blocking":
            comparison = figures.get("comparison", {})
            return f"equal={comparison.get('equal')} max|dw|={comparison.get('max_abs_weight_difference')}"
        if name == "sanitizer":
            enabled, races = figures.get("sanitizer_enabled"), figures.get("races_reported")
            return f"enabled={enabled} races={races} rc={figures.get('child_rc')}"
        if name == "profiler":
            trace = figures.get("trace", {})
            side = trace.get("side_streams", {})
            rates = " ".join(
                f"{d}: {_round(s.get('gbps_large'))} GB/s ({_round(s.get('gbps_vs_plain_copy'))}x plain)"
                for d, s in side.items()
            )
            return f"checks={trace.get('checks')} overlap={_round(trace.get('overlap_fraction'))} {rates}"
        if name == "cuda_tests":
            return (f"{figures.get('tests')} tests, {figures.get('failures')} failures, {figures.get('errors')} errors,"
                    f" {figures.get('skipped')} skipped; failed: {[f['test'] for f in figures.get('failed', [])]}")
        if name == "benchmark":
            return "; ".join(
                f"{p['strategy']}: {_round(p['step_s'])} s/step ({_round(p['step_time_vs_plain'])}x),"
                f" {p['peak_device_mib']} MiB ({_round(p['peak_memory_vs_plain'])}x)" for p in figures.get("points", [])
            )
    except (KeyError, TypeError, ValueError) as error:
        return f"(figures unreadable: {error})"
    return ""


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    summary = summarize(args.logs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print("\n== gpu_check summary ==")
    for name, part in summary["parts"].items():
        timing = f" {part['seconds']}/{part['limit_s']} s" if "seconds" in part else ""
        print(f"{name:16s} {part['status']:10s}{timing}  {_headline(name, part)}")
    print(f"overall: {'PASSED' if summary['passed'] else 'NOT PASSED'} in {summary['total_s']} s")


if __name__ == "__main__":
    main()
