// An empty kernel for the driver's occupancy query: how many thread-block clusters of each size
// can be resident at once with one CTA an SM (runtime.cluster_capacity). The answer depends on the
// GPU's GPC layout (a cluster sits inside one GPC), not on what the kernel does, as long as its
// shared memory keeps it at one CTA an SM; the W4A16 dispatcher uses it to know which k splits can
// run as clusters before it compiles anything.
extern "C" __global__ void tf_cluster_capacity() {}
