# One image for every kvmesh role: `docker run kvmesh serve ROLE`, configured by KVMESH_* variables.
#
# Layers, slowest first, so a code change rebuilds in seconds: a virtualenv with torch (the CPU build), then the
# project's other dependencies (read from pyproject.toml, re-installed only when that list changes; torch's C++
# test binaries dropped: 83 MB nobody runs; triton, which xgrammar pulls in, dropped: 1 GB that only the CUDA
# device module and xgrammar's GPU mask kernel import, neither of which a CPU image runs), then the source,
# installed editable without dependencies.
#
#   docker build -t kvmesh .
#   docker build --build-arg TORCH_INDEX_URL=https://my-mirror/whl/cpu -t kvmesh .   # torch from another index
ARG PYTHON_IMAGE=python:3.11-slim

# The dependency list alone. COPY --from below is cached by the file's content, so editing pyproject.toml
# elsewhere (test extras, tool settings) does not re-install anything.
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb')); \
print('\n'.join(p['build-system']['requires'] + p['project']['dependencies']))" > /tmp/requirements.txt

FROM ${PYTHON_IMAGE}
# Where torch comes from. PyPI's Linux wheel is the CUDA build (several GB with its nvidia-* packages); the CPU
# build lives on PyTorch's own index. A torch wheel that pip can already find without any index (a find-links
# directory in the base image's pip.conf, as in offline mirrors) wins, so builds in such places never wait on
# an index they cannot reach.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVMESH_MODEL_DIR=/models \
    KVMESH_HOST=0.0.0.0

COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN python -m venv $VIRTUAL_ENV \
    && torch=$(grep -E '^torch[=<>~ ]' /tmp/requirements.txt) \
    && { pip install --no-deps --no-index "$torch" 2>/dev/null \
         || pip install --no-deps --index-url "$TORCH_INDEX_URL" "$torch"; } \
    && pip install -r /tmp/requirements.txt \
    && pip uninstall -y -q triton \
    && rm -rf $VIRTUAL_ENV/lib/python3*/site-packages/torch/test \
    && mkdir -p /models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto proto
COPY services services
COPY libs libs
# bytecode now: PYTHONDONTWRITEBYTECODE keeps every container from compiling (and discarding) it at each start
RUN pip install --no-deps --no-build-isolation -e . && python -m compileall -q libs services

# Models: mount a volume at /models (`kvmesh models pull` writes there; roles read it).
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
