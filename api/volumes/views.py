"""``/volumes``: list, create, get (with the content token), delete (409 while mounted)."""
from adrf.views import APIView
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response

from api.fields import ErrorSerializer
from api.requests import team_of, valid
from api.volumes.serializers import NewVolumeSerializer, VolumeAndTokenSerializer, VolumeSerializer
from lifecycle.volumes import records

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404, 409, 500)}


class VolumesView(APIView):
    @extend_schema(operation_id="volumes_list", responses={200: VolumeSerializer(many=True), **ERRORS})
    async def get(self, request):
        return Response(VolumeSerializer(await records.list_volumes(team_of(request)), many=True).data)

    @extend_schema(operation_id="volumes_create", request=NewVolumeSerializer,
                   responses={201: VolumeAndTokenSerializer, **ERRORS})
    async def post(self, request):
        body = valid(NewVolumeSerializer, request.data).validated_data
        volume = await records.create_volume(team_of(request), body["name"])
        return Response(VolumeAndTokenSerializer(volume).data, status=status.HTTP_201_CREATED)


class VolumeView(APIView):
    @extend_schema(operation_id="volume_get", responses={200: VolumeAndTokenSerializer, **ERRORS})
    async def get(self, request, volume_id: str):
        return Response(VolumeAndTokenSerializer(await records.get_volume(team_of(request), volume_id)).data)

    @extend_schema(operation_id="volume_delete", responses={204: None, **ERRORS})
    async def delete(self, request, volume_id: str):
        await records.delete_volume(team_of(request), volume_id)
        return Response(status=status.HTTP_204_NO_CONTENT)
