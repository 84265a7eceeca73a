"""The client side of an engine core: in-process, on a thread behind asyncio, or in processes of
their own, with data-parallel routing across several cores."""
