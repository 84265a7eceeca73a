"""The engine core: the model, the pools, the scheduler and the step loop, in-process or in its own
process (ZMQ, msgspec messages); the frontend side tokenizes, detokenizes and streams."""
