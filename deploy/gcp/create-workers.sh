#!/usr/bin/env bash
# gradwire workers on Google Compute Engine: N GPU VMs, each running `worker serve` in the gradwire
# container with the run's token and TLS, reachable on port 50051 from the coordinator's address only.
#
#   PROJECT=my-project ZONE=us-central1-a COORDINATOR_IP=203.0.113.7 IMAGE=REGION-docker.pkg.dev/.../gradwire:cuda \
#     WORKERS=2 bash deploy/gcp/create-workers.sh
#
# Before: build and push the CUDA image (deploy/README.md); make a token (openssl rand -hex 32 > token) and
# a CA and worker certificates whose SANs hold the VMs' external IPs or DNS names (docs/real-machines.md,
# "Tokens and TLS"); put token, worker.crt, worker.key in a bucket the VMs' service account can read: GS_SECRETS=gs://bucket/path.
# After: coordinator train --workers IP1:50051,IP2:50051 --token-file token --tls-ca ca.crt ...
set -euo pipefail

: "${PROJECT:?set PROJECT}" "${ZONE:?set ZONE}" "${COORDINATOR_IP:?set COORDINATOR_IP (the only address allowed in)}"
: "${IMAGE:?set IMAGE (the gradwire CUDA image)}" "${GS_SECRETS:?set GS_SECRETS (gs:// path of token, worker.crt, worker.key)}"
WORKERS="${WORKERS:-2}"
MACHINE="${MACHINE:-g2-standard-8}"      # one NVIDIA L4; a2-highgpu-1g for an A100
ACCELERATOR="${ACCELERATOR:-type=nvidia-l4,count=1}"
PORT=50051
TAG=gradwire-worker

# Only the coordinator may reach the workers' port.
if ! gcloud compute firewall-rules describe "$TAG-grpc" --project "$PROJECT" >/dev/null 2>&1; then
    gcloud compute firewall-rules create "$TAG-grpc" --project "$PROJECT" --direction INGRESS \
        --allow "tcp:$PORT" --source-ranges "$COORDINATOR_IP/32" --target-tags "$TAG"
fi

STARTUP=$(cat <<SCRIPT
#!/bin/bash
set -e
mkdir -p /etc/gradwire && cd /etc/gradwire
gsutil cp "$GS_SECRETS/token" "$GS_SECRETS/worker.crt" "$GS_SECRETS/worker.key" .
chown -R 10001 /etc/gradwire && chmod 600 token worker.key
docker run -d --restart unless-stopped --name gradwire-worker --gpus all -p $PORT:$PORT \
    -v /etc/gradwire:/etc/gradwire:ro "$IMAGE" \
    worker serve --port $PORT --device cuda --nproc-per-node auto --token-file /etc/gradwire/token \
    --tls-cert /etc/gradwire/worker.crt --tls-key /etc/gradwire/worker.key --grace 20
SCRIPT
)

for i in $(seq 1 "$WORKERS"); do
    gcloud compute instances create "$TAG-$i" --project "$PROJECT" --zone "$ZONE" \
        --machine-type "$MACHINE" --accelerator "$ACCELERATOR" --maintenance-policy TERMINATE \
        --image-family common-cu124-ubuntu-2204 --image-project deeplearning-platform-release \
        --boot-disk-size 200GB --metadata install-nvidia-driver=True --metadata-from-file startup-script=<(echo "$STARTUP") \
        --scopes storage-ro --tags "$TAG"
done
gcloud compute instances list --project "$PROJECT" --filter "tags.items=$TAG" --format "value(name,networkInterfaces[0].accessConfigs[0].natIP)"
