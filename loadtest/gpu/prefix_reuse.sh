#!/usr/bin/env bash
# GPU calls (issue 16, long conversations): one H200, full-size dummy weights, 1-GPU profile. 10-turn voice
# conversations (`omnirt bench realtime --turns 10`, each reply cancelled at its first audio, sessions with
# instructions of their own), per turn of the conversation: response latency, prompt tokens reused and
# prefilled. PARTS picks what runs, in this order (default: both; each part is one server, ~4 min at
# SESSIONS "1 32", more with 64: split them over calls; SESSIONS_reuse / SESSIONS_full set one part's):
#   reuse  prefix caching on (as served);
#   full   the same with --no-prefix-caching (every turn prefills its whole history): the baseline.
# After each point the server's /metrics lines of the reuse (prompt tokens computed vs cached per stage,
# resident slots and the bytes they keep beyond the KV cache) go to $OUT/metrics-PART.txt, and the KV cache
# sizes from the server log beside them: the memory the reuse takes, against the KV budget.
# Then: python -m loadtest.plot_compare docs/benchmarks/realtime/h200-turns.png \
#   h200-turns-reuse.json=reuse h200-turns-full.json=full
source loadtest/gpu/common.sh
PARTS=${PARTS:-reuse full}
for part in $PARTS; do
  args=(--realtime-max-sessions 160)
  [ "$part" = full ] && args+=(--no-prefix-caching)
  start_server "turns-$part" "${args[@]}" --log-level info || exit 1
  grep -E "KV cache:" "$OUT/server-turns-$part.log" | sed "s/^/$part /"
  counts=SESSIONS_$part
  for n in ${!counts:-${SESSIONS:-1 32 64}}; do
    timeout ${POINT_LIMIT:-400} python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL \
      --sessions $n --turns 10 --mode cancel --clients 8 --name "h200-turns-$part-$n" --out "$OUT" 2>&1 \
      | grep -E "^\| [0-9]|^\| turn|^- |Error|error"
    python3 -c "import httpx; print('\n'.join(l for l in httpx.get('http://127.0.0.1:8091/metrics').text.splitlines()
                if l.startswith(('omnirt_stage_prefill', 'omnirt_stage_resident'))))" \
      | sed "s/^/$part $n sessions: /" | tee -a "$OUT/metrics-$part.txt"
  done
  stop_server
  python3 - "$OUT" "$part" <<'EOF'
import json, pathlib, sys
out, part = pathlib.Path(sys.argv[1]), sys.argv[2]
runs = sorted(out.glob(f"h200-turns-{part}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
rows = [r for p in runs for r in json.loads(p.read_text())["results"]]
(out / f"h200-turns-{part}.json").write_text(json.dumps({"args": {"parts": [p.name for p in runs]}, "results": rows}))
EOF
done
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
