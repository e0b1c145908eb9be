"""The report: gpu_check.json rewritten after every section (a killed run keeps what it
finished) and the markdown of each section's result (the newer sections render their own, in
their modules) and of the bundle."""

from __future__ import annotations

import json
import math
import pathlib

from jaxserve.tools.gpu_check.decode_trace import md_decode_trace
from jaxserve.tools.gpu_check.gmm_timing import md_gmm_row
from jaxserve.tools.gpu_check.int4_timing import md_int4_row
from jaxserve.tools.gpu_check.launch_floor import md_launch_floor
from jaxserve.tools.gpu_check.prediction import md_prediction
from jaxserve.tools.gpu_check.preflight import md_preflight
from jaxserve.tools.gpu_check.step_dump import md_step_dump


def fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, spec)
    return str(v)


def md_bandwidth(r: dict) -> list[str]:
    return [f"- copy bandwidth (read+write): {r['copy_bw_Bps'] / 1e12:.3f} TB/s "
            f"({r['copy_vs_nominal']:.2f} x nominal 4.3 TB/s)",
            f"- read bandwidth (max-reduction): {r['read_bw_Bps'] / 1e12:.3f} TB/s",
            f"- dispatch floor: {r['dispatch_floor_s'] * 1e6:.1f} us per jitted call",
            f"- bf16 matmul {r['matmul_n']}^3: {r['matmul_bf16_flops'] / 1e12:.1f} TFLOP/s "
            f"({r['matmul_vs_nominal']:.2f} x nominal 790)"]


def md_correctness(r: dict) -> list[str]:
    out = ["| kernel | case | max abs err | max rel err | ok |", "|---|---|---|---|---|"]
    for kind in ("paged_attention", "int4_matmul", "ragged_attention", "ragged_extra",
                 "lora_sgmv", "registered"):
        for row in r.get(kind, []):
            if "error" in row or kind == "registered":
                if "error" not in row:
                    out.append(f"| {row['case']} | (registered) | {fmt(row['max_abs_err'])} | "
                               f"{fmt(row.get('max_rel_err'))} | "
                               f"{'yes' if row['within_tol'] else 'NO'} |")
                    continue
                out.append(f"| {kind} | {row['case']} | ERROR: {row['error'][:120]} | | no |")
                continue
            case = (f"{row['model']} bs{row['block_size']} B{row['batch']} "
                    f"maxlen {row['max_len']}" if kind == "paged_attention" else
                    f"{row['model']} bs{row['block_size']} R{row['rows']} T{row['tokens']} "
                    f"maxlen {row['max_len']}" if kind == "ragged_attention" else
                    f"{row['model']} bs{row['block_size']} R{row['rows']} {row['dtype']} "
                    f"cache {row['cache_bytes'] / 2**30:.2f} GiB" if kind == "ragged_extra" else
                    lora_case_name(row) if kind == "lora_sgmv" else
                    f"{row['model']} {row['K']}->{row['N']} M{row['M']} g{row['group_size']}")
            out.append(f"| {kind} | {case} | {fmt(row['max_abs_err'])} | "
                       f"{fmt(row['max_rel_err'])} | {'yes' if row['within_tol'] else 'NO'} |")
            mosaic = row.get("mosaic", {})
            if "max_abs_err" in mosaic:  # the Mosaic GPU kernel on the same case
                out.append(f"| {kind} (Mosaic GPU) | {case} | {fmt(mosaic['max_abs_err'])} | "
                           f"{fmt(mosaic['max_rel_err'])} | "
                           f"{'yes' if mosaic['within_tol'] else 'NO'} |")
    return out


def lora_case_name(row: dict) -> str:
    return (f"{row['model']} {row['K']}->{row['N']} M{row['M']} S{row['slots']} "
            f"R{row['rank']} ({row['no_adapter']} without)")


def md_lora_timing(row: dict) -> str:
    """A lora_sgmv row of the timings table: XLA = the same tiling in XLA."""
    if "error" in row:
        return f"| lora_sgmv | {row['case']} | ERROR: {row['error'][:120]} ||||||||"
    k, x = row["kernel"], row["xla_tiled"]
    return (f"| lora_sgmv | {lora_case_name(row)} | {row['bytes_per_call'] / 1e6:.2f} | "
            f"{k['median_s'] * 1e6:.1f} | {k['bytes_per_s'] / 1e12:.3f} | "
            f"{k['vs_nominal_bw']:.2f} | {fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
            f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | {x['median_s'] * 1e6:.1f} | "
            f"{row['kernel_over_xla_tiled']:.2f} | wrapper (sort + scatter) "
            f"{row['wrapper']['median_s'] * 1e6:.1f} us; per-token gather XLA "
            f"{row['per_token_xla']['median_s'] * 1e6:.1f} us |")


def md_timings(r: dict) -> list[str]:
    out = [f"{r.get('method', '')}", "",
           "| kernel | case | MB/call | kernel us | TB/s | x4.3 | x meas. copy | x meas. read | "
           "XLA us | kernel/XLA | extra |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind in ("paged_attention", "int4_matmul"):
        for row in r.get(kind, []):
            if "error" in row:
                out.append(f"| {kind} | {row['case']} | ERROR: {row['error'][:120]} ||||||||")
                continue
            if kind == "int4_matmul":
                out.append(md_int4_row(row, fmt))
                continue
            k, x = row["kernel"], row["xla_engine_path"]
            case = f"{row['model']} bs{row['block_size']} B{row['batch']}"
            extra = f"f32 ref {row['reference_f32']['median_s'] * 1e6:.1f} us"
            out.append(f"| {kind} | {case} | {row['bytes_per_call'] / 1e6:.2f} | "
                       f"{k['median_s'] * 1e6:.1f} | {k['bytes_per_s'] / 1e12:.3f} | "
                       f"{k['vs_nominal_bw']:.2f} | {fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
                       f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | "
                       f"{x['median_s'] * 1e6:.1f} | {row['kernel_over_xla_engine_path']:.2f} | "
                       f"{extra} |")
    for row in r.get("ragged_attention", []):
        if "error" in row:
            out.append(f"| ragged_attention | {row['case']} | ERROR: {row['error'][:120]} ||||||||")
            continue
        k, x, ref = row["kernel"], row["xla_engine_path"], row["reference_f32"]
        out.append(f"| ragged_attention | {row['model']} bs{row['block_size']} R{row['rows']} "
                   f"T{row['tokens']} | {row['bytes_per_call'] / 1e6:.2f} | "
                   f"{k['median_s'] * 1e6:.1f} | {k['bytes_per_s'] / 1e12:.3f} | "
                   f"{k['vs_nominal_bw']:.2f} | {fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
                   f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | {x['median_s'] * 1e6:.1f} | "
                   f"{row['kernel_over_xla_engine_path']:.2f} | f32 ref "
                   f"{ref['median_s'] * 1e6:.1f} us ({row['kernel_over_reference_f32']:.2f}x)"
                   + (f"; Mosaic GPU {row['mosaic_kernel']['median_s'] * 1e6:.1f} us "
                      f"({row['kernel_over_mosaic_kernel']:.2f}x)" if "mosaic_kernel" in row
                      else "")
                   + (f"; int8 cache: Triton {row['kernel_int8']['median_s'] * 1e6:.1f} us"
                      if "kernel_int8" in row else "")
                   + (f", Mosaic GPU {row['mosaic_kernel_int8']['median_s'] * 1e6:.1f} us "
                      f"({row['kernel_int8_over_mosaic_kernel_int8']:.2f}x)"
                      if "mosaic_kernel_int8" in row else "") + " |")
    out += [md_lora_timing(row) for row in r.get("lora_sgmv", [])]
    out += [md_gmm_row(row, fmt) for row in r.get("grouped_matmul", [])]
    return out


def md_e2e(r: dict) -> list[str]:
    out = [f"- model: {r['model']} ({r['num_params'] / 1e6:.0f}M params), source: "
           f"{r['source']}, block {r['block_size']}", "",
           "| weights / backend | batch | decode tok/s | steps/s | overall tok/s | "
           "MBU (weights) vs 4.3 | vs measured copy | step ms: host / wait / total | "
           "compiles in run | lengths ok |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for v in r["variants"]:
        label = f"{v.get('quantization') or 'bf16'} / {v.get('backend')}"
        if "error" in v or "skipped" in v:
            out.append(f"| {label} | {v.get('error') or v.get('skipped')} ||||||||")
            continue
        for run in v["runs"]:
            if "skipped" in run:
                out.append(f"| {label} | {run['batch']} | {run['skipped']} |||||||")
                continue
            out.append(f"| {label} | {run['batch']} | {fmt(run['decode_tok_s'], '.1f')} | "
                       f"{fmt(run['decode_steps_per_s'], '.1f')} | "
                       f"{fmt(run['overall_tok_s'], '.1f')} | "
                       f"{fmt(run.get('mbu_weights_vs_nominal'), '.3f')} | "
                       f"{fmt(run.get('mbu_weights_vs_measured_copy'), '.3f')} | "
                       f"{md_step_ms(run.get('step_breakdown', {}))} | "
                       f"{run['compiles_during_run']} | {run['all_lengths_ok']} |")
        if v.get("note"):
            out.append(f"\nnote ({label}): {v['note']}\n")
    return out


def md_step_ms(b: dict) -> str:
    if not b.get("steps"):
        return "-"
    return " / ".join(f"{b[k] * 1e3:.2f}" for k in ("median_host_s", "median_wait_s",
                                                     "median_total_s"))


def md_llm_defaults(r: dict) -> list[str]:
    c = r["config"]
    return [f"- {r['source']}: built in {r['construct_s']:.1f}s, {r['generated']} tokens in "
            f"{r['generate_s']:.2f}s ({r['tok_s']:.1f} tok/s), lengths ok {r['all_lengths_ok']}",
            f"- defaults: dtype {c.get('dtype')} (model {r['model_dtype']}), attention "
            f"{c.get('attention_backend')}, linear {c.get('linear_backend')}, kv_cache_dtype "
            f"{c.get('kv_cache_dtype')}, block {c.get('block_size')}, warmup {c.get('warmup')}",
            f"- steps {r['step_totals'].get('num_steps')}: schedule "
            f"{r['step_totals'].get('schedule_s', 0):.3f}s, device "
            f"{r['step_totals'].get('device_s', 0):.3f}s (wait "
            f"{r['step_totals'].get('wait_s', 0):.3f}s), postprocess "
            f"{r['step_totals'].get('postprocess_s', 0):.3f}s; compiles after warm-up "
            f"{r['num_compiles_after_warmup']}"]


def md_hf(r: dict) -> list[str]:
    out = [f"- {r['source']} on {r['device']}, torch {r['torch']}, transformers "
           f"{r['transformers']}, bf16", "", "| batch | decode tok/s | overall tok/s |",
           "|---|---|---|"]
    for run in r["runs"]:
        if "skipped" in run:
            out.append(f"| {run['batch']} | {run['skipped']} | |")
        else:
            out.append(f"| {run['batch']} | {fmt(run['decode_tok_s'], '.1f')} | "
                       f"{fmt(run['overall_tok_s'], '.1f')} |")
    return out


def md_kernel_tests(r: dict) -> list[str]:
    return [f"- `{r['command']}`: {r.get('summary') or 'timed out'}", "", "```",
            r["output_tail"][-1500:], "```"]


MD = {"preflight": md_preflight, "bandwidth": md_bandwidth,
      "kernel_correctness": md_correctness, "kernel_timings": md_timings,
      "launch_floor": md_launch_floor, "decode_trace": md_decode_trace,
      "e2e_llama3_8b": md_e2e, "e2e_smollm2": md_e2e, "llm_defaults": md_llm_defaults,
      "step_dump": md_step_dump, "hf_peer": md_hf, "kernel_tests": md_kernel_tests,
      "prediction": md_prediction}


def md_bundle(b: dict) -> list[str]:
    if "error" in b:
        return [f"- bundle failed: {b['error']}"]
    return [f"- `{b['tar']}`: {b['tar_bytes'] / 2**20:.2f} MiB, {b['included']} files, "
            f"{len(b['truncated'])} truncated, {len(b['left_out'])} left out (MANIFEST.json "
            f"inside lists them); dumps first written to `{b['scratch_dir']}`",
            f"- out dir within the return limits: "
            f"{'yes' if not b['out_dir_problems'] else b['out_dir_problems']}"]


def markdown(report: dict) -> str:
    lines = [f"# gpu_check {'(dry run, CPU)' if report['dry_run'] else ''}", "",
             f"command: `{report['command']}`", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec['seconds']:.1f}s)", ""]
        if sec.get("reason"):
            lines += [f"reason: {sec['reason']}", ""]
        if sec.get("error"):
            lines += ["```", sec["error"], "```", ""]
        if sec.get("result") and sec["status"] != "skipped":
            try:
                lines += MD[name](sec["result"]) + [""]
            except Exception as e:  # noqa: BLE001 - the JSON has everything anyway
                lines += [f"(markdown rendering failed: {type(e).__name__}: {e})", ""]
    if report.get("bundle"):
        lines += ["## bundle", ""] + md_bundle(report["bundle"]) + [""]
    return "\n".join(lines)


def write_report(out_dir: pathlib.Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out_dir / "gpu_check.json")
