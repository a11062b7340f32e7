//! The revocation RPCs of the client library (administrators only): revoke an identity, lift a
//! revocation, list them.

use toolsrv_proto::v1::{
    ListRevocationsRequest, Revocation, RevokeRequest, RevokeResponse, UnrevokeRequest,
};

use crate::{Client, ClientError};

impl Client {
    /// Revokes `identity` (`agent/<host-id>` or `client/<name>`): the coordinator refuses every
    /// certificate naming it from now on and closes its open connections.
    pub async fn revoke(
        &self,
        identity: &str,
        reason: &str,
    ) -> Result<RevokeResponse, ClientError> {
        let request = RevokeRequest {
            identity: identity.to_string(),
            reason: reason.to_string(),
        };
        Ok(self.inner.clone().revoke(request).await?.into_inner())
    }

    /// Lifts the revocation of `identity`; returns the record removed.
    pub async fn unrevoke(&self, identity: &str) -> Result<Revocation, ClientError> {
        let request = UnrevokeRequest {
            identity: identity.to_string(),
        };
        let response = self.inner.clone().unrevoke(request).await?.into_inner();
        response.removed.ok_or_else(|| {
            ClientError::Protocol("the coordinator named no revocation removed".into())
        })
    }

    /// Every revoked identity, sorted.
    pub async fn revocations(&self) -> Result<Vec<Revocation>, ClientError> {
        let response = self
            .inner
            .clone()
            .list_revocations(ListRevocationsRequest {})
            .await?;
        Ok(response.into_inner().revocations)
    }
}
