"""The three splitgemma processes (installed as splitgemma.services): gateway, prefill worker, decode worker."""
