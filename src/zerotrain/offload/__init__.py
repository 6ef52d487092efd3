"""NVMe offload: swap files and asynchronous file I/O for offloaded training state."""
