"""Model pairs: loading (named pairs, hub ids, paths), the tiny random pair, the offline pair's fetch,
attention and CPU kernels, and which device a pair runs on."""
