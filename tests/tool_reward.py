"""Rewards that read TRL's conversational completions (a tool loop's assistant and tool messages) and its
`environments=`: importable as 'tests.tool_reward:tool_messages' from the repository root, so a sharded Lab's ranks
import them too (Ray puts the driver's working directory on their path). A plain-text completion makes it raise."""


def tool_messages(prompts, completions, **kwargs):
    """Each completion's tool messages, counted (a completion must be a list of messages)."""
    return [float(sum(message["role"] == "tool" for message in completion)) for completion in completions]


def environment_calls(prompts, completions, **kwargs):
    """Each row's environment's tool calls (its `calls`, as the rollout left it; TRL's `environments=`)."""
    return [float(e.calls) for e in kwargs["environments"]]
