"""The OpenAPI 3.0 description of the bridge's HTTP API, served at /openapi.json.

Written by hand (four routes) so it states the limits and error answers the code enforces; the
fuzz test posts what this spec allows and what it does not, and expects no 5xx either way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["spec"]

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def _err(text: str) -> dict[str, Any]:
    return {"description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def spec(max_body_bytes: int, max_alerts: int) -> dict[str, Any]:
    alert = {
        "type": "object",
        "required": ["status", "labels", "startsAt", "fingerprint"],
        "properties": {
            "status": {"type": "string", "enum": ["firing", "resolved"]},
            "labels": {**_STRING_MAP, "required": ["alertname"]},
            "annotations": _STRING_MAP,
            "startsAt": {"type": "string", "format": "date-time"},
            "endsAt": {"type": "string", "format": "date-time"},
            "generatorURL": {"type": "string"},
            "fingerprint": {"type": "string", "minLength": 1, "maxLength": 128},
        },
    }
    webhook = {
        "type": "object",
        "required": ["version", "status", "alerts"],
        "properties": {
            "version": {"type": "string", "enum": ["4"]},
            "groupKey": {"type": "string"},
            "truncatedAlerts": {"type": "integer", "minimum": 0},
            "status": {"type": "string", "enum": ["firing", "resolved"]},
            "receiver": {"type": "string"},
            "groupLabels": _STRING_MAP,
            "commonLabels": _STRING_MAP,
            "commonAnnotations": _STRING_MAP,
            "externalURL": {"type": "string"},
            "alerts": {"type": "array", "maxItems": max_alerts,
                       "items": {"$ref": "#/components/schemas/Alert"}},
        },
    }
    auth_errors = {"401": _err("missing or wrong credentials")}
    return {
        "openapi": "3.0.3",
        "info": {"title": "robust-metrics action bridge", "version": "1",
                 "description": "Alertmanager webhook receiver that checkpoints, dumps stacks, "
                                "restarts and drains, once per alert instance."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "basic": {"type": "http", "scheme": "basic"}},
            "schemas": {"Alert": alert, "Webhook": webhook, "Error": _ERROR},
        },
        "security": [{"bearer": []}, {"basic": []}],
        "paths": {
            "/api/v1/alerts": {"post": {
                "summary": "Alertmanager webhook (payload version 4)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Webhook"}}},
                    "description": f"at most {max_body_bytes} bytes"},
                "responses": {
                    "200": {"description": "recorded; actions run in the background",
                            "content": {"application/json": {"schema": {
                                "type": "object",
                                "properties": {k: {"type": "integer"} for k in (
                                    "accepted", "duplicates", "unmatched", "resolved",
                                    "cancelled")}}}}},
                    "400": _err("body is not JSON"),
                    **auth_errors,
                    "413": _err(f"body larger than {max_body_bytes} bytes"),
                    "415": _err("content type is not application/json"),
                    "422": _err("JSON is not an Alertmanager v4 payload; the message names "
                                "the field"),
                    "503": _err("the alerts could not be recorded; Alertmanager retries"),
                }}},
            "/api/v1/actions": {"get": {
                "summary": "Audit trail of alert instances and the steps taken, newest first",
                "parameters": [
                    {"name": "run", "in": "query", "schema": {"type": "string"}},
                    {"name": "status", "in": "query", "schema": {"type": "string", "enum": [
                        "pending", "running", "done", "failed", "skipped", "cancelled",
                        "ignored"]}},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                ],
                "responses": {"200": {"description": "incidents with their steps"},
                              "400": _err("bad query parameter"), **auth_errors}}},
            "/api/v1/incidents": {"get": {
                "summary": "The incident ledger, newest first: per incident its run, alert, ranks "
                           "and nodes named, fault, detected, acted and recovered times, steps "
                           "lost and outcome",
                "parameters": [
                    {"name": "run", "in": "query", "schema": {"type": "string"}},
                    {"name": "alertname", "in": "query", "schema": {"type": "string"}},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                ],
                "responses": {"200": {"description": "ledger entries"},
                              "400": _err("bad query parameter"), **auth_errors}}},
            "/api/v1/nodes": {"get": {
                "summary": "Incidents per node within the node window, most first",
                "responses": {"200": {"description": "node counts"},
                              "400": _err("bad query parameter"), **auth_errors}}},
            "/metrics": {"get": {"summary": "Prometheus metrics of the bridge", "security": [],
                                 "responses": {"200": {"description": "text format"}}}},
            "/healthz": {"get": {"summary": "liveness", "security": [],
                                 "responses": {"200": {"description": "ok"}}}},
            "/openapi.json": {"get": {"summary": "this document", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3"}}}},
        },
    }
