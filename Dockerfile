# FleetMedic: one image for the worker, the webhook and the node agent (`fleetmedic <command>`).
#
#   docker build -t fleetmedic:0.1.0 .
#
# Build stage: wheels for FleetMedic and its dependencies. Final stage: a slim Python with the
# wheels installed, Slurm's client (scontrol/squeue, and munge for its auth) for the worker's
# Slurm writes, no compilers, and a non-root user.
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleetmedic ./fleetmedic
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
RUN pip wheel --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends slurm-client munge \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links /wheels fleetmedic && rm -rf /wheels
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin fleetmedic
USER 10001
EXPOSE 8080 9400 9464
ENTRYPOINT ["fleetmedic"]
CMD ["worker"]
