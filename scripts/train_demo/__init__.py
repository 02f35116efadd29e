"""Training-time pieces of the demo model: config, modules, data, checkpoint export."""
