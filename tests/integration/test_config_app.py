"""SOLIDLOOP_* settings checked by init_app against a real Flask app and database."""

from __future__ import annotations

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import ConfigurationError, SolidLoop


def test_init_app_rejects_invalid_config(database_url):
    app = Flask("bad")
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url
    app.config["SOLIDLOOP_LEASE_MARGIN"] = 0
    db = SQLAlchemy(app)
    with pytest.raises(ConfigurationError, match="SOLIDLOOP_LEASE_MARGIN"):
        SolidLoop(app, db)
    assert "solidloop" not in app.extensions


def test_double_init_raises(app):
    ext = app.extensions["solidloop"].extension
    with pytest.raises(RuntimeError, match="already initialised"):
        ext.init_app(app)
