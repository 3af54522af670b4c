"""What the scheduler and the worker processes share: configuration, TLS loading, the
control channel's limits and the decoding strategies. Neither service package imports the
other; both import this one."""
