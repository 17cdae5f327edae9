# One image for the three pdflash services; the command picks one:
#   docker run IMAGE serve-scheduler | serve-verifier | serve-drafter | up | generate | health
#
# Build (CPU torch from docker/wheels/ when docker/wheels.sh put a wheel there):
#   docker/wheels.sh && docker build -t pdflash .
# Offline machines without an image registry build FROM a local base (docker/engine.sh makes one):
#   docker build --build-arg BASE_IMAGE=pdflash-base:bookworm -t pdflash .
# GPU image: torch from PyPI (its Linux wheel is the CUDA build): see compose.gpu.yaml.
#   docker build --build-arg TORCH_WHEEL=none --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t pdflash:gpu .
#
# No `# syntax=` line and no RUN --mount: the classic builder (docker-compose 1.29) must build it.

ARG BASE_IMAGE=python:3.11-slim

# Stage 1: a venv with the dependencies only; rebuilt when pyproject.toml or the torch choice changes.
FROM ${BASE_IMAGE} AS deps
ARG TORCH_VERSION=2.13.0
# auto: install docker/wheels/torch-*.whl when present, else torch from TORCH_INDEX_URL; none: always the index.
ARG TORCH_WHEEL=auto
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=120
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first and on its own: the project's `torch>=2.6` from PyPI would be the multi-GB CUDA build.
COPY docker/wheels/ /tmp/wheels/
RUN set -eu; \
    if [ "$TORCH_WHEEL" = auto ] && ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install /tmp/wheels/torch-*.whl; \
    else \
        pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"; \
    fi; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# The other dependencies from pyproject.toml alone (the light ones and the `serve` extra), so editing the
# source keeps this layer cached.
COPY pyproject.toml /src/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['serve']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# Stage 2: the project as a wheel (setuptools is in the venv already: no build isolation needed).
FROM deps AS project
COPY . /src
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /dist /src


# Stage 3: the runtime. The big venv layer stays cached across source edits; only the small
# project wheel layer changes.
FROM ${BASE_IMAGE}
COPY --from=deps /opt/venv /opt/venv
# PDFLASH_HOST: the services bind loopback by default; in a container they must listen on all
# interfaces to be reachable from the other containers (only the drafter's port is published).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PDFLASH_HOST=0.0.0.0
COPY --from=project /dist /tmp/dist
# /models: where a model directory is mounted (compose: PDFLASH_MODEL_DIR); the embedded demo
# model needs nothing there.
RUN pip install --no-deps --no-cache-dir --disable-pip-version-check /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && pip check \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/pdflash pdflash \
    && mkdir -p /models && chown pdflash:pdflash /models
USER pdflash
WORKDIR /home/pdflash
# Resolve the default model now, not in each container at start: a no-op when the demo assets ship;
# without them it makes the tiny stand-in checkpoint once, so the verifier and drafter share it.
RUN python -c "from pdflash.defaults import default_target_dir; print('default model:', default_target_dir())"
EXPOSE 50051 50052 50053 9101 9102 9103
# Readiness of whichever service runs here: PDFLASH_PORT is its gRPC port (compose sets it).
HEALTHCHECK --interval=5s --timeout=10s --start-period=120s --retries=3 \
    CMD pdflash health "127.0.0.1:${PDFLASH_PORT:-50051}"
ENTRYPOINT ["pdflash"]
CMD ["--help"]
