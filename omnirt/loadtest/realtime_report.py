"""The voice bench's rows and tables (`omnirt bench realtime`): a point's figures from its turns, as JSON rows and
markdown; the diagnostic modes labelled so."""

from __future__ import annotations

import argparse

from omnirt.loadtest import server_metrics
from omnirt.loadtest.realtime_mic import FRAMES_PER_S
from omnirt.loadtest.stats import NOTE, cell, summary

DIAGNOSTIC = ("cancel", "no-responses")  # modes that are not how people converse: labelled so in every report


def replies(args: argparse.Namespace) -> str:
    """Whether the replies were pinned, as the report says it."""
    if getattr(args, "reply_frames", None):
        return f"pinned at {args.reply_frames} frames ({args.reply_frames / FRAMES_PER_S:.1f} s)"
    return "unpinned (the model's own length, up to the server's limit)"


def mode_label(mode: str) -> str:
    return f"{mode} (diagnostic)" if mode in DIAGNOSTIC else mode


def summarize(n: int, turns: list[dict], errors: list[str], args: argparse.Namespace, server_cpu: float | None,
              client_cpu: float) -> dict:
    wants_audio, plays = args.mode != "no-responses", args.mode not in DIAGNOSTIC
    return {"sessions": n, "mode": args.mode, "replies": replies(args), "transcription": args.transcribe,
            "turns": len(turns),
            "expected_turns": n * args.turns, "front_end": front_end(args),
            "vad_lag_ms": summary([t["vad_lag_ms"] for t in turns]),
            "turn_end_ms": summary([t["turn_end_ms"] for t in turns]),
            "cut_ins": sum(t["cut_ins"] for t in turns), "turns_cut": sum(t["cut_ins"] > 0 for t in turns),
            "response_ms": summary([t["response_ms"] for t in turns]),
            "voice_to_voice_ms": summary([t["voice_to_voice_ms"] for t in turns]),
            "transcript_ms": summary([t["transcript_ms"] for t in turns]),
            "transcripts_failed": sum(t["transcript_failed"] for t in turns),
            "turns_without_audio": sum(t["first_audio"] is None for t in turns) if wants_audio else 0,
            "turns_without_speech_stopped": sum(t["speech_stopped"] is None for t in turns),
            "underruns": sum(t["underruns"] for t in turns) if plays else None,
            "underruns_per_reply": sum(t["underruns"] for t in turns) / len(turns) if plays and turns else None,
            "reply_audio_s": summary([t["audio_s"] for t in turns]) if plays else None,
            "errors": len(errors), "error_samples": errors[:5],
            "server_cpu_per_session": server_cpu / n if server_cpu is not None else None,
            "client_cpu": client_cpu, "by_turn": _by_turn(turns)}


def front_end(args: argparse.Namespace) -> str:
    """The sessions' turn detection, noise reduction and speech, as the report names them."""
    td = "server_vad" if args.turn_detection == "server_vad" else f"semantic_vad ({args.eagerness})"
    noise = "" if args.noise_reduction == "off" else f", {args.noise_reduction}"
    return f"{td}{noise}{', paused speech' if args.speech == 'paused' else ''}"


def _mean(values: list) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def _by_turn(turns: list[dict]) -> list[dict]:
    """Per turn of the conversation (1-based, warm-up turns counted): latency percentiles over the
    sessions, and the mean prompt, reused and prefilled tokens of the turn's response."""
    rows = []
    for index in sorted({t["index"] for t in turns}):
        at = [t for t in turns if t["index"] == index]
        prompt, cached = _mean([t["input_tokens"] for t in at]), _mean([t["cached_tokens"] for t in at])
        rows.append({"turn": index + 1, "vad_lag_ms": summary([t["vad_lag_ms"] for t in at]),
                     "response_ms": summary([t["response_ms"] for t in at]),
                     "voice_to_voice_ms": summary([t["voice_to_voice_ms"] for t in at]), "input_tokens": prompt,
                     "cached_tokens": cached,
                     "prefilled_tokens": None if prompt is None or cached is None else prompt - cached})
    return rows


def markdown(rows: list[dict], title: str) -> str:
    head = ("| sessions | abusive | mode | front end | transcripts | turns | VAD lag ms p50/p90/p99 | turn end ms "
            "p50/p90/p99 | false cut-ins (turns) | response ms p50/p90/p99 | voice-to-voice ms p50/p90/p99 | "
            "transcript ms p50/p90/p99 | no audio | underruns | errors | server CPU per session | client CPU |\n|"
            + "---|" * 17 + "\n")
    abuse = "".join(f"\n- {r['sessions']} sessions, {r['abusive']} abusive: {kind}: {a['connections']} connections, "
                    f"closed {a['closes']}, errors {a['errors']}" for r in rows for kind, a in r["abuse"].items())
    return (f"### {title}\n\n{head}" + "".join(_row(r) for r in rows) + abuse + "\n" + _point_lines(rows)
            + _turns_markdown(rows) + f"\n{NOTE}\n")


def _point_lines(rows: list[dict]) -> str:
    """Per point: the replies (pinned or not), underruns per reply, rows a step per stage from the engine's own
    counters (mean / p90), and the GPU's use."""
    out = []
    for r in rows:
        per_reply = r.get("underruns_per_reply")
        gpu = r.get("gpu_pct")
        out.append(f"- {r['sessions']} sessions, {mode_label(r['mode'])}: replies {r.get('replies', '-')}; "
                   f"underruns per reply {'-' if per_reply is None else f'{per_reply:.2f}'}; rows a step per stage "
                   f"(mean / p90): {server_metrics.batch_cell(r.get('rows_per_step', {}))}; GPU "
                   f"{'- (no nvidia-smi)' if gpu is None else f'{gpu:.0f}%'}\n")
    return "".join(out)


def _turns_markdown(rows: list[dict]) -> str:
    """Per session count, a row per turn; and the server's prefill counters over the point."""
    rows = [r for r in rows if r.get("by_turn") and r["mode"] != "no-responses"]
    if not rows:
        return ""
    num = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    out = ["\n| turn | sessions | response ms p50 / p90 | voice-to-voice ms p50 | prompt tokens | reused | "
           "prefilled |\n|---|---|---|---|---|---|---|\n"]
    for r in rows:
        out += [f"| turn {t['turn']} | {r['sessions']} | {cell(t['response_ms'], ('p50', 'p90'))} | "
                f"{cell(t['voice_to_voice_ms'], ('p50',))} | {num(t['input_tokens'])} | "
                f"{num(t['cached_tokens'])} | {num(t['prefilled_tokens'])} |\n" for t in r["by_turn"]]
    out += [f"\n- {r['sessions']} sessions, server prompt tokens over the point: "
            + "; ".join(f"{stage} {c.get('computed', 0):.0f} computed, {c.get('cached', 0):.0f} reused"
                        for stage, c in r.get("prefill_tokens", {}).items())
            + f"; engine, submission to each stage's first output, mean ms: "
              f"{server_metrics.first_output_cell(r.get('first_output_ms', {}))}; engine steps over the point: "
              f"{server_metrics.engine_cell(r.get('engine', {}))}" for r in rows]
    return "".join(out) + "\n"


def _row(r: dict) -> str:
    server_cpu = "-" if r["server_cpu_per_session"] is None else f"{r['server_cpu_per_session']:.3f}"
    underruns = "-" if r["underruns"] is None else r["underruns"]
    transcripts = f"on ({r['transcripts_failed']} failed)" if r.get("transcription") else "off"
    cut = f"{r['cut_ins']} ({r['turns_cut']})" if "cut_ins" in r else "-"
    return (f"| {r['sessions']} | {r['abusive']} | {mode_label(r['mode'])} | {r.get('front_end', 'server_vad')} | "
            f"{transcripts} | "
            f"{r['turns']}/{r['expected_turns']} | {cell(r['vad_lag_ms'])} | "
            f"{cell(r['turn_end_ms']) if 'turn_end_ms' in r else '-'} | {cut} | {cell(r['response_ms'])} | "
            f"{cell(r['voice_to_voice_ms'])} | "
            f"{cell(r['transcript_ms']) if 'transcript_ms' in r else '-'} | "
            f"{r['turns_without_audio']} | {underruns} | {r['errors']} | {server_cpu} | {r['client_cpu']:.2f} |\n")


