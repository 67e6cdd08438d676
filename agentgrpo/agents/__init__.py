"""Agents written elsewhere, trained as they are: the OpenAI-compatible episode endpoint,
`AgentEnv`, `serve-policy`, and tools from MCP servers."""

from agentgrpo.agents.agent_env import AgentEnv

__all__ = ["AgentEnv"]
