#!/bin/sh
# The image's HEALTHCHECK: grpc.health.v1 through the flce CLI, on the
# plaintext health port (--health_address, 8081 by default in the image) so
# it needs no certificates. FLCE_HEALTH_ADDRESS overrides the address.
exec /opt/flce/bin/flce --server="${FLCE_HEALTH_ADDRESS:-127.0.0.1:8081}" --timeout=4s health
