"""The segment server's HTTP face: the Flask app, its blueprints, the front door, the CLI."""
