"""mds performance harness and recorded results (see bench/RESULTS.md)."""
