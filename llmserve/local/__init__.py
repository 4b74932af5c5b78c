"""The stack on one machine (`llmserve up`): Valkey, the service processes, their supervisor.
"""
