"""Scheduling: queues, policies, token budget, chunked prefill and preemption."""
