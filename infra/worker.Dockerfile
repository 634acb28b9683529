# The image of sidecar's workers in infra/docker-compose.yml: Prefect's image at the version prefect.yaml names,
# with this checkout installed at /opt/sidecar (the directory the deployments' pull step changes into).
FROM prefecthq/prefect:3.9.1-python3.11
WORKDIR /opt/sidecar
COPY . /opt/sidecar
RUN pip install --no-cache-dir /opt/sidecar
ENV SIDECAR_REPO=/opt/sidecar \
    SIDECAR_HOME=/var/cache/sidecar \
    HF_HUB_OFFLINE=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_LOGGING_EXTRA_LOGGERS=storage
