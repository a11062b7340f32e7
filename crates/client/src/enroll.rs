//! Enrollment administration through the client API: join tokens (`toolctl token create`,
//! `list`, `revoke`).

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::{Request, Response, Status};
use toolsrv_proto::v1::join_tokens_client::JoinTokensClient;
use toolsrv_proto::v1::join_tokens_server::{JoinTokens, JoinTokensServer};
use toolsrv_proto::v1::{
    CreateJoinTokenRequest, CreateJoinTokenResponse, JoinTokenInfo, ListJoinTokensRequest,
    ListJoinTokensResponse, RevokeJoinTokenRequest, RevokeJoinTokenResponse,
};

use crate::{Client, ClientError};

impl Client {
    /// Creates a one-time join token for `host_id`, usable for `ttl` (`None`: the coordinator's
    /// default, one hour), binding `labels` to the host's certificate. Only clients matching the
    /// coordinator's `--admin` may; others get PERMISSION_DENIED.
    pub async fn create_join_token(
        &self,
        host_id: &str,
        ttl: Option<Duration>,
        labels: BTreeMap<String, String>,
    ) -> Result<CreateJoinTokenResponse, ClientError> {
        let request = CreateJoinTokenRequest {
            host_id: host_id.to_string(),
            ttl_seconds: ttl.map_or(0, |t| t.as_secs().max(1)),
            labels,
        };
        let response = JoinTokensClient::new(self.channel.clone())
            .create_join_token(request)
            .await?;
        Ok(response.into_inner())
    }

    /// The join tokens the coordinator keeps, newest first (administrators only).
    pub async fn join_tokens(&self) -> Result<Vec<JoinTokenInfo>, ClientError> {
        let response = JoinTokensClient::new(self.channel.clone())
            .list_join_tokens(ListJoinTokensRequest {})
            .await?;
        Ok(response.into_inner().tokens)
    }

    /// Revokes the unused token `id` (its id, or at least 8 of its first hex digits).
    pub async fn revoke_join_token(&self, id: &str) -> Result<JoinTokenInfo, ClientError> {
        let response = JoinTokensClient::new(self.channel.clone())
            .revoke_join_token(RevokeJoinTokenRequest { id: id.to_string() })
            .await?;
        Ok(response.into_inner().token.unwrap_or_default())
    }
}

/// `JoinTokens` passed on unchanged over a `toolctl master`'s connection (see
/// [`crate::control`]), as the `Tools` RPCs are.
pub(crate) fn relay(upstream: tonic::transport::Channel) -> JoinTokensServer<TokenRelay> {
    JoinTokensServer::new(TokenRelay {
        upstream: JoinTokensClient::new(upstream),
    })
}

#[derive(Debug)]
pub(crate) struct TokenRelay {
    upstream: JoinTokensClient<tonic::transport::Channel>,
}

#[tonic::async_trait]
impl JoinTokens for TokenRelay {
    async fn create_join_token(
        &self,
        req: Request<CreateJoinTokenRequest>,
    ) -> Result<Response<CreateJoinTokenResponse>, Status> {
        self.upstream
            .clone()
            .create_join_token(req.into_inner())
            .await
    }

    async fn list_join_tokens(
        &self,
        req: Request<ListJoinTokensRequest>,
    ) -> Result<Response<ListJoinTokensResponse>, Status> {
        self.upstream
            .clone()
            .list_join_tokens(req.into_inner())
            .await
    }

    async fn revoke_join_token(
        &self,
        req: Request<RevokeJoinTokenRequest>,
    ) -> Result<Response<RevokeJoinTokenResponse>, Status> {
        self.upstream
            .clone()
            .revoke_join_token(req.into_inner())
            .await
    }
}
