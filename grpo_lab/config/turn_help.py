"""The help texts of the generator's multi-turn knobs (models_and_devices.py is at its size cap)."""

TOOL_RESPONSE_HELP = (
    "With tools: the most tokens a tool result keeps (its text cut to them, as verl's max_tool_response_length); "
    "null = no bound of its own: the trajectory budget (max_completion_length) is the bound, and the plan says so."
)
TURN_CACHE_HELP = (
    "hf backend with tools, growing cache: keep = each turn goes on from the KV cache of the turns before it (only "
    "the tool result's tokens prefilled; rows that finish leave the batch between turns, not within one); prefill = "
    "each turn prefills the whole conversation again (TRL's loop). The same tokens either way."
)
