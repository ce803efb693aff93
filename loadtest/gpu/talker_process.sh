#!/usr/bin/env bash
# GPU call (issue: the engine core process, "a stage in another process costs little"): the transport's
# CUDA IPC test, then c=$CONC at prompt 160 with every stage in the engine core (inline), with the Talker
# in a worker process of its own on the same GPU handing tensors over in device memory (talker-worker),
# and the same with device tensors staged through host shared memory (talker-worker-host), each with a
# server of its own, in the same call. POINTS picks the variants; /dev/shm is compared before and after.
source loadtest/gpu/common.sh
CONC=${CONC:-64}
ls /dev/shm > "$OUT/shm-before.txt"
python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_transport.py > "$OUT/transport-test.txt" 2>&1
tail -3 "$OUT/transport-test.txt" | sed 's/^/transport-test /'
echo "left in /dev/shm by the test: $(ls /dev/shm | comm -13 "$OUT/shm-before.txt" - | tr '\n' ' ')"
for p in ${POINTS:-inline talker-worker talker-worker-host}; do
  case $p in
    inline) point inline "$CONC" ;;
    talker-worker) point talker-worker "$CONC" --stage-overrides '{"1": {"own_process": true}}' ;;
    talker-worker-host) point talker-worker-host "$CONC" --stage-overrides '{"1": {"own_process": true, "device_ipc": false}}' ;;
  esac
done
ls /dev/shm > "$OUT/shm-after.txt"
echo "left in /dev/shm: $(comm -13 "$OUT/shm-before.txt" "$OUT/shm-after.txt" | tr '\n' ' ')"
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
