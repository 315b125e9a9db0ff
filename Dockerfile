# FleetMedic: one image for the worker, the webhook and the node agent (`fleetmedic <command>`).
#
#   docker build -t fleetmedic:0.1.0 .
#
# Build stage: wheels for FleetMedic and its dependencies. Final stage: a slim Python with the
# wheels installed, Slurm's client (scontrol/squeue, and munge for its auth) for the worker's
# Slurm writes, no compilers, and a non-root user.
#
# Reproducible: the base image by digest (the tag in the comment), every Python dependency pinned
# with its hashes in requirements.lock (pip-compile), checked with --require-hashes. To update:
# README "Reproducible images".
# python:3.11.11-slim-bookworm
FROM python:3.11.11-slim-bookworm@sha256:081075da77b2b55c23c088251026fb69a7b2bf92471e491ff5fd75c192fd38e5 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements.lock ./
RUN pip wheel --require-hashes --wheel-dir /wheels -r requirements.lock
COPY pyproject.toml README.md ./
COPY fleetmedic ./fleetmedic
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
RUN pip wheel --no-deps --wheel-dir /wheels .

# python:3.11.11-slim-bookworm
FROM python:3.11.11-slim-bookworm@sha256:081075da77b2b55c23c088251026fb69a7b2bf92471e491ff5fd75c192fd38e5
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends slurm-client munge \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# Only what the build stage fetched (hash-checked) and built: no index, nothing resolved again.
RUN pip install --no-index --no-deps /wheels/*.whl && rm -rf /wheels
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin fleetmedic
USER 10001
EXPOSE 8080 9400 9464
ENTRYPOINT ["fleetmedic"]
CMD ["worker"]
