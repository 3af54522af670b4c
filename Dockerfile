# seqserve image: ONE image for both processes.
#
#   scheduler:  docker run ... seqserve                      (default CMD: seqserve-scheduler)
#   worker:     docker run ... seqserve seqserve-worker
#
# The scheduler (CPU only: gRPC/HTTP API, iteration loop, max-sparsity batch splitting)
# and the worker (holds the model and its KV caches, runs the forward passes) are the same
# Python package, so they ship as the same image and differ only in the command
# (docker-compose.yml runs it as `scheduler`, `worker` and `worker-gpu`). Both read the
# same serving.properties: /opt/ml/model/serving.properties (the DJL LMI location; a copy
# of deploy/serving.properties is baked in, mount your own over it) via $SERVING_PROPERTIES,
# or pass `--properties FILE`. OPTION_* variables and --flags override the file.
#
# Build (CPU torch, the default):
#   docker build -t seqserve .
# Build with a CUDA torch (for a GPU worker; needs the NVIDIA container toolkit to run):
#   docker build -t seqserve:cuda --build-arg TORCH_INDEX=https://pypi.org/simple .
#   docker build -t seqserve:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Keep TORCH_SPEC at the version pyproject.toml pins (torch==2.13.0), or `pip install .`
# below replaces the torch you picked with the one it requires.
#
# A tiny random-weight Llama is generated at build time into /models/tiny-llama (no model
# download: `docker compose up` works offline). Serve a real model by mounting its
# directory and setting option.model_id (or OPTION_MODEL_ID) to the mounted path.

FROM python:3.11-slim

# Which torch to install: the CPU wheel by default.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler: the worker builds its bfloat16 attention and fused-layer loops at start
# (worker_service/kernels/native_attention.c, prompt_attention.c, fused_layers.c); without one it keeps bf16 KV in
# float32 on CPU and runs those layers eagerly.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is by far the largest dependency and changes rarely.
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY . /src
RUN pip install . \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# The default model: tiny random-weight Llama written with the project's fixtures tool.
RUN python -m worker_service.fixtures make-model --arch llama --out /models/tiny-llama

# Default configuration (mount your own serving.properties over it).
COPY deploy/serving.properties /opt/ml/model/serving.properties
ENV SERVING_PROPERTIES=/opt/ml/model/serving.properties

# Run unprivileged; Hugging Face caches go to a writable home.
RUN useradd --create-home --uid 1000 seqserve \
    && chmod -R a+rX /models /opt/ml
USER seqserve
ENV HF_HOME=/home/seqserve/.cache/huggingface
WORKDIR /home/seqserve

# scheduler: 8000 gRPC, 8080 HTTP, 8001 metrics; worker: 8100 gRPC, 8101 metrics
EXPOSE 8000 8080 8001 8100 8101

CMD ["seqserve-scheduler"]
