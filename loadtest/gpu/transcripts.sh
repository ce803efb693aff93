#!/usr/bin/env bash
# GPU call (issue 17, transcripts of the user): one H200, full-size dummy weights, 1-GPU profile. Reply latency
# (`speech_stopped` -> first audio delta) with and without transcripts of the user in the same run:
# `omnirt bench realtime --transcription both` runs each point without, then with
# `input_audio_transcription`, and reports the transcript latency (`speech_stopped` -> `.completed`) beside it.
# MODES: cancel (each reply cancelled at its first audio: latency alone) and full (whole replies: underruns
# while a transcription shares the Thinker with the rest of the reply). One server, ~5 min at SESSIONS "1 32".
source loadtest/gpu/common.sh
start_server transcripts --realtime-max-sessions 160 || exit 1
for mode in ${MODES:-cancel full}; do
  for n in ${SESSIONS:-1 32}; do
    timeout ${POINT_LIMIT:-300} python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL \
      --sessions $n --turns 3 --mode $mode --clients 8 --transcription both --name "h200-transcripts-$mode-$n" \
      --out "$OUT" 2>&1 | grep -E "^\| [0-9]|Error|error"
  done
done
stop_server
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
