// The pause program of the test node's sandbox image (make .tools/k8s/pause); the standard library only.
module rawmm.dev/tools/k8s/pause

go 1.26.0
