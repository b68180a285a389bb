// Pins prometheus-operator, whose module carries the monitoring.coreos.com CRDs the cluster tests install
// (make .tools/k8s/prometheus-operator-crds): nothing here is built.
module rawmm.dev/tools/k8s/prometheus-operator

go 1.26

require github.com/prometheus-operator/prometheus-operator v0.85.0 // indirect
