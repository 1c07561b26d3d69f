"""The ServerApp and ClientApp: fedppl's Flower runtime, with the task the run config names."""

from fedppl.runtime.flower import FlowerApp, task_from_config

app = FlowerApp(task_from_config)
server_app = app.server_app()
client_app = app.client_app()
