//! Certificates for the test control plane: one CA, the API server's serving certificate,
//! an admin client certificate, and the service-account signing key.

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A PEM certificate and its PEM private key.
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A certificate authority that signs serving and client certificates.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    key_pem: String,
}

impl TestCa {
    pub fn new(common_name: &str) -> Result<Self> {
        let key = KeyPair::generate()?;
        let key_pem = key.serialize_pem();
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Ok(Self {
            issuer: CertifiedIssuer::self_signed(params, key)?,
            key_pem,
        })
    }

    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A server certificate valid for `names` (DNS names or IP addresses).
    pub fn serving(&self, common_name: &str, names: &[&str]) -> Result<CertPair> {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate; Kubernetes reads the user from CN and groups from O.
    pub fn client(&self, user: &str, groups: &[&str]) -> Result<CertPair> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        for group in groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Result<CertPair> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The key pair the API server signs service-account tokens with (ES256).
pub fn service_account_key() -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}
