"""drf-spectacular glue: tells the OpenAPI schema how the API authenticates."""
from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "api.auth.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "X-API-Key"}


class AdminTokenScheme(OpenApiAuthenticationExtension):
    target_class = "api.auth.AdminTokenAuthentication"
    name = "AdminTokenAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "X-Admin-Token"}


class NodeBearerScheme(OpenApiAuthenticationExtension):
    target_class = "api.auth.NodeBearerAuthentication"
    name = "NodeBearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}


class OptionalNodeBearerScheme(OpenApiAuthenticationExtension):
    """POST /nodes/join: a join token as Bearer, or none (a Kubernetes token in the body)."""
    target_class = "api.auth.OptionalNodeBearerAuthentication"
    name = "NodeJoinBearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}

    def get_security_requirement(self, auto_schema):
        return [{self.name: []}, {}]


class OptionalApiKeyScheme(ApiKeyScheme):
    """The same key on the routes a person may call instead (``api.teams``)."""
    target_class = "api.auth.OptionalApiKeyAuthentication"
    name = "ApiKeyAuthOrPerson"


class AccessTokenScheme(OpenApiAuthenticationExtension):
    """E2B's ``AccessTokenAuth``: a person's ``sk_e2b_…`` token as Bearer."""
    target_class = "api.auth.AccessTokenAuthentication"
    name = "AccessTokenAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "access_token"}
