# omnirt on one CUDA GPU host: the server, a deploy profile, the weights from a volume, /health as the health
# check. CUDA torch wheels bring their own CUDA libraries; the host needs the NVIDIA driver and the NVIDIA
# Container Toolkit (`docker run --gpus all`). Build and run: docs/deploy.md.
FROM python:3.11-slim

# A C compiler for Triton's kernel launchers (the slot-attention and fused-experts kernels, torch.compile).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from PyTorch's CUDA index: pip would otherwise pick whatever build PyPI offers.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/omnirt
COPY pyproject.toml README.md ./
COPY omnirt ./omnirt
# serving only: the server and WebRTC (the load-test tools' own packages stay out of the image). The
# wheel holds the demo page and the deploy profiles: `--deploy-config NAME` finds a shipped profile.
RUN pip install --no-cache-dir ".[webrtc]"

RUN useradd --create-home --uid 1000 omnirt
USER omnirt
ENV OMNIRT_HOST=0.0.0.0 \
    OMNIRT_PORT=8091 \
    OMNIRT_MODEL=/models/Qwen3-Omni-30B-A3B-Instruct \
    OMNIRT_PROFILE=qwen3_omni_moe_1gpu \
    HF_HUB_OFFLINE=1
VOLUME ["/models"]
EXPOSE 8091
# Loading the 30B checkpoint and capturing graphs takes minutes: /health is only asked after a start period.
HEALTHCHECK --start-period=900s --interval=15s --timeout=5s --retries=3 \
    CMD ["/opt/omnirt/omnirt/deploy/docker/entrypoint.sh", "health"]
ENTRYPOINT ["/opt/omnirt/omnirt/deploy/docker/entrypoint.sh"]
