"""Full-size start-up plus a few timed requests in-process, with thread dumps if anything stalls."""
import asyncio
import faulthandler
import os
import sys
import time

from app.cli import build_parser, load_engine
from pipeline.request import AudioChunk, Finished, OmniRequest, TextDelta

dump = open(os.path.join(os.environ.get("OUT", "/tmp"), "stacks.txt"), "w")
faulthandler.dump_traceback_later(int(os.environ.get("DIAG_TIMEOUT", "200")), exit=True, file=dump)
t0 = time.perf_counter()
engine = load_engine(build_parser().parse_args(["serve", *sys.argv[1:]]))
print(f"engine ready {time.perf_counter() - t0:.1f}s", flush=True)


async def one(i: int, frames: int) -> None:
    t = time.perf_counter()
    req = OmniRequest(f"d{i}", [{"role": "user", "content": "hello " * 150}], ("text", "audio"),
                      thinker_sampling={"max_tokens": 40, "min_tokens": 40, "temperature": 0.0},
                      talker_sampling={"max_tokens": frames + 1, "min_tokens": frames + 1})
    first_text = first_audio = None
    n = 0
    async for ev in await engine.submit(req):
        now = time.perf_counter() - t
        if isinstance(ev, TextDelta) and first_text is None:
            first_text = now
        elif isinstance(ev, AudioChunk):
            first_audio = first_audio or now
            n += ev.num_samples
        elif isinstance(ev, Finished):
            print(f"req {i}: ttft {first_text:.3f} ttfp {first_audio} total {now:.2f} audio {n / 24000:.2f}s "
                  f"{ev.finish_reason} {ev.error}", flush=True)


async def main() -> None:
    await one(0, 20)
    for c in (1, 16, 64):
        t = time.perf_counter()
        await asyncio.gather(*(one(100 * c + i, 145) for i in range(c)))
        wall = time.perf_counter() - t
        print(f"c={c}: {c} requests in {wall:.2f}s = {c / wall:.2f} req/s", flush=True)


asyncio.run(main())
faulthandler.cancel_dump_traceback_later()
engine.stop()
