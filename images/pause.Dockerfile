# The kubelet's pod sandbox image, built here because no registry is reachable in CI.
#
# e2e/harness/images/ compiles images/pause/pause.c (`gcc -Os -static`) into a build context that
# holds only the binary, then:
#   docker build -f images/pause.Dockerfile -t registry.k8s.io/pause:3.10 <that directory>
# The tag is the containerd `sandbox_image`, so the node never tries to pull it.
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
