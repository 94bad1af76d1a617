"""The Markdown report of a tune run: what was checked, measured and chosen, in a form to share."""

from __future__ import annotations

from typing import List


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def markdown(profile: dict) -> str:
    key = profile["key"]
    out = [f"# lily-mlx tune report: {key['device']} ({key['backend']})", "",
           f"- device: {key['device']}; backend: {key['backend']}; MLX {key['mlx']}; lily-mlx {key['lily']}",
           f"- model: {profile['model']}",
           f"- command: `{profile['command']}`; {profile['created']}",
           f"- shape classes: {', '.join(profile['classes'])} (decode@N: one token after N in the cache, /kv4 a 4-bit "
           "cache, /b4 a server's batch of 4 rows of N, N/2, N/4 and N/8; "
           "prefill@N: a chunk of N tokens); medians of {rounds} alternating rounds".format(rounds=profile["rounds"]),
           f"- error: largest |kernel - reference| of the layer's output over its largest |reference|; "
           f"a kernel counts as wrong beyond {profile['tolerance']:g}, and as slower beyond a time ratio of {profile['slower_ratio']:.2f} (geometric mean "
           "over the shape classes where it runs)", ""]

    out += ["## Choices (applied by `patch()` / `--lily` on this device; `LILY_TUNE=off` ignores them)", ""]
    rows = [[f"`{n}`" + (" (trial kernel)" if e.get("trial") else ""), e["choice"], e.get("reason") or e.get("note", "")]
            for n, e in profile["ops"].items()]
    out += _table(["op", "runs", "why"], rows) + [""]
    rows = [[f"`{n}`", e["choice"], e.get("reason") or e.get("note", "")] for n, e in profile["switches"].items()]
    out += _table(["switch", "state", "why / note"], rows) + [""]

    out += ["## Kernel checks (each kernel alone against its reference, then each family's together)", ""]
    rows = [[c["what"], c["class"], "not run alone" if not c["ran"] else ("ok" if c["ok"] else "**differs**"),
             f"{c['error']:.2g}" if c["ran"] else "-"] for c in profile["checks"]]
    out += _table(["kernel", "shape", "result", "error"], rows) + [""]

    out += ["## Kernel vs reference (time per layer call; ratio < 1: the kernel is faster)", ""]
    rows = [[f"`{r['op']}`", r["class"], f"{r['kernel_ms']:.3f}", f"{r['reference_ms']:.3f}", f"{r['ratio']:.2f}"]
            for r in profile["op_timings"]]
    out += _table(["op", "shape", "kernel ms", "reference ms", "ratio"], rows) + [""]

    out += ["## Switches on vs off (time per layer call; ratio < 1: on is faster)", ""]
    rows = [[f"`{r['switch']}`", r["family"], r["class"], f"{r['on_ms']:.3f}", f"{r['off_ms']:.3f}", f"{r['ratio']:.2f}"]
            for r in profile["switch_timings"]]
    out += _table(["switch", "layer", "shape", "on ms", "off ms", "ratio"], rows) + [""]
    out += ["## Batch invariance (a token's bits alone, in a decode batch, in a prompt chunk)", ""]
    rows = [[r["what"], " / ".join(str(t) for t in r["tokens"]) + " tokens",
             "bitwise equal" if r["equal"] else "**differ**" + (f" ({r['failure']})".replace("|", "/")
                                                                 if "failure" in r else "")]
            for r in profile.get("invariance", [])]
    empty = "(no MoE layer)" if "invariance" in profile else "(not checked: a profile from before this check)"
    out += (_table(["check", "calls", "result"], rows) if rows else [empty]) + [""]
    out += ["Share this file (and the JSON profile next to it) as it is: it names the device and versions "
            "and holds no paths other than the model's.", ""]
    return "\n".join(out)
