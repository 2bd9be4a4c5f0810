# The tpuft operator image: `tpuft operator` with no torch and no training stack (those live in
# trainer_image/Dockerfile). Build from the repository root:  docker build -t tpuft-operator .
# Versions come from the pinned requirements/operator.txt that the tests install; the base is pinned
# to an exact patch release (CI resolves and records its digest when it builds).
FROM python:3.11.14-slim-bookworm

# Read-only root filesystem in the chart: no bytecode written at run time (pip compiles it at build),
# and HOME points at the one writable mount, /tmp (an emptyDir).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# The chart's pod securityContext runs as 10001:10001; the numeric USER below lets runAsNonRoot verify it.
RUN groupadd --gid 10001 tpuft \
 && useradd --uid 10001 --gid tpuft --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin tpuft

WORKDIR /opt/tpuft
# All requirement files: pyproject.toml reads them (dynamic metadata) when the package is built,
# but only operator.txt is installed.
COPY requirements/ requirements/
RUN pip install --no-cache-dir pip==25.3 \
 && pip install --no-cache-dir -c requirements/constraints.txt -r requirements/operator.txt

COPY pyproject.toml README.md ./
# Not devtools/: tpuft_dev (the local cluster, the demo) is a development tool, absent here.
COPY operator/ operator/
# tpuft_trainer ships with the package (the operator reads its exit-code table); importing it pulls in
# no torch, and the trainer extra is not installed.
COPY trainer_image/tpuft_trainer/ trainer_image/tpuft_trainer/
# --no-deps: every dependency is already installed from operator.txt; the [trainer] extra is never named.
# pip compiles the bytecode at install time; the sources are then in site-packages only.
RUN pip install --no-cache-dir --no-deps . \
 && rm -rf /opt/tpuft/operator /opt/tpuft/trainer_image

USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["tpuft"]
CMD ["operator"]
